"""``expense-approval``: a deterministic policy gate, then an LLM rationale; approve or reject.

Whether an expense is reimbursable is policy, so code decides it: per-category limits in USD (fixed
conversion table), accepted currencies, a description long enough to justify the spend, no alcohol on
meals, and a cap above which finance must approve outside this flow. The model only writes the
one-sentence rationale for the decision the rules reached, through a conditional edge to the
approving or the rejecting prompt. ``reasons`` lists every rule that fired (or the limit met).
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel, ConfigDict, Field

from elesium.graphs.llm import WorkflowState, llm_node
from elesium.graphs.registry import Workflow

USD_PER_UNIT = {"USD": 1.0, "EUR": 1.08, "GBP": 1.27, "CHF": 1.13, "CAD": 0.73, "AUD": 0.66, "JPY": 0.0067}
LIMITS_USD = {
    "meals": 75.0,
    "travel": 1500.0,
    "lodging": 400.0,
    "software": 500.0,
    "equipment": 2000.0,
    "training": 1000.0,
    "office": 300.0,
}
HARD_CAP_USD = 5000.0
ALCOHOL = ("beer", "wine", "bar tab", "alcohol", "cocktail", "whisky", "vodka", "champagne")
MIN_DESCRIPTION_WORDS = 3


class ExpenseInput(BaseModel):
    """An expense claim."""

    model_config = ConfigDict(extra="forbid")

    employee: str = Field(min_length=1, max_length=100)
    amount: float = Field(gt=0, strict=True)
    currency: str = Field(min_length=3, max_length=3)
    category: str = Field(min_length=1, max_length=40)
    description: str = Field(min_length=1, max_length=1000)


class ExpenseState(WorkflowState, total=False):
    employee: str
    amount: float
    currency: str
    category: str
    description: str
    amount_usd: float | None
    limit_usd: float | None
    violations: list[str]
    decision: str
    rationale: str
    reasons: list[str]


def check_policy(claim: dict[str, Any]) -> tuple[float | None, float | None, list[str]]:
    """(amount in USD, the category's limit in USD, violated rules), each rule a sentence."""
    violations: list[str] = []
    currency = str(claim["currency"]).upper()
    category = str(claim["category"]).strip().lower()
    rate = USD_PER_UNIT.get(currency)
    amount_usd = round(float(claim["amount"]) * rate, 2) if rate is not None else None
    limit = LIMITS_USD.get(category)
    if rate is None:
        violations.append(
            f"currency {currency} is not reimbursable (accepted: {', '.join(sorted(USD_PER_UNIT))})"
        )
    if limit is None:
        violations.append(
            f"category {category!r} is not in the policy (allowed: {', '.join(sorted(LIMITS_USD))})"
        )
    if amount_usd is not None and amount_usd > HARD_CAP_USD:
        violations.append(
            f"{amount_usd:.2f} USD is above the {HARD_CAP_USD:.0f} USD cap for this flow; "
            "finance must approve it"
        )
    elif amount_usd is not None and limit is not None and amount_usd > limit:
        violations.append(f"{amount_usd:.2f} USD exceeds the {category} limit of {limit:.0f} USD")
    description = str(claim["description"]).lower()
    if len(description.split()) < MIN_DESCRIPTION_WORDS:
        violations.append(
            f"the description needs at least {MIN_DESCRIPTION_WORDS} words to justify the expense"
        )
    if category == "meals" and any(word in description for word in ALCOHOL):
        violations.append("alcohol is not reimbursable")
    return amount_usd, limit, violations


def policy(state: ExpenseState) -> dict[str, Any]:
    """The rule gate: the decision is made here, before the model is asked anything."""
    amount_usd, limit, violations = check_policy(dict(state))
    return {
        "amount_usd": amount_usd,
        "limit_usd": limit,
        "violations": violations,
        "decision": "reject" if violations else "approve",
    }


def next_after_policy(state: ExpenseState) -> str:
    return "explain_approval" if state["decision"] == "approve" else "explain_rejection"


CLAIM = "Expense claim by {employee}: {amount} {currency} for {category}: {description}\n"
explain_approval = llm_node(
    "explain_approval",
    output_key="rationale",
    params={"max_tokens": 40, "stop": ["\n"]},
    prompt=CLAIM + "It is within the {category} limit of {limit_usd} USD and is approved. "
    "Explain the approval in one sentence.",
)
explain_rejection = llm_node(
    "explain_rejection",
    output_key="rationale",
    params={"max_tokens": 40, "stop": ["\n"]},
    prompt=lambda s: (
        CLAIM.format(**s)
        + "The policy rejects it: "
        + "; ".join(s["violations"])
        + ". Write one sentence to {employee} explaining why the claim is rejected.".format(**s)
    ),
)


def finalise(state: ExpenseState) -> dict[str, Any]:
    if state["decision"] == "approve":
        within = (
            f"{state['amount_usd']:.2f} USD is within the {state['category'].strip().lower()} limit of "
            f"{state['limit_usd']:.0f} USD"
        )
        reasons = [within, "the description justifies the expense"]
    else:
        reasons = list(state["violations"])
    return {"reasons": reasons}


def build() -> StateGraph:
    builder = StateGraph(ExpenseState)
    builder.add_node("policy", policy)
    builder.add_node(explain_approval)
    builder.add_node(explain_rejection)
    builder.add_node("finalise", finalise)
    builder.add_edge(START, "policy")
    builder.add_conditional_edges("policy", next_after_policy, ["explain_approval", "explain_rejection"])
    builder.add_edge("explain_approval", "finalise")
    builder.add_edge("explain_rejection", "finalise")
    builder.add_edge("finalise", END)
    return builder


def workflow() -> Workflow:
    return Workflow.define(
        "expense-approval",
        build,
        ExpenseInput,
        description="Check an expense claim against the policy rules and explain the "
        "approve/reject decision.",
    )
