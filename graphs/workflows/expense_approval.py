"""``expense-approval``: a deterministic policy gate, an explanation that cites the rules; approve or reject.

Whether an expense is reimbursable is policy, so code decides it: per-category limits in USD (fixed
conversion table), accepted currencies, a description long enough to justify the spend, no alcohol on
meals, and a cap above which finance must approve outside this flow. Every rule has an id
(``RULES``); ``rules`` lists the ids that fired and ``reasons`` their sentences (or the limit met).

The explanation is built from the rules' own sentences, so it always cites the rule that decided
(a model asked to explain a rejection wrote plausible sentences that cited none). The model's part
is the one thing rules cannot do: name what the money was for, copied from the claim's description
under a grammar that only admits the description's own words.
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
    rules: list[str]
    violations: list[str]
    decision: str
    purpose: str | None
    rationale: str
    reasons: list[str]


RULES = {
    "currency": "is not a reimbursable currency",
    "category": "is not a category in the policy",
    "cap": "is above the cap for this flow",
    "limit": "exceeds the limit for",
    "description": "the description needs at least",
    "alcohol": "alcohol is not reimbursable",
}
"""Each rule's id and the phrase its sentence always contains (what ``cites`` looks for)."""


def cites(rationale: str, rule: str) -> bool:
    """Whether an explanation cites ``rule`` (an id of ``RULES``)."""
    return RULES[rule] in rationale


def check_policy(claim: dict[str, Any]) -> tuple[float | None, float | None, list[tuple[str, str]]]:
    """(amount in USD, the category's limit in USD, violated rules as (id, sentence) pairs)."""
    violations: list[tuple[str, str]] = []
    currency = str(claim["currency"]).upper()
    category = str(claim["category"]).strip().lower()
    rate = USD_PER_UNIT.get(currency)
    amount_usd = round(float(claim["amount"]) * rate, 2) if rate is not None else None
    limit = LIMITS_USD.get(category)
    if rate is None:
        violations.append(("currency", f"{currency} {RULES['currency']} (accepted: "
                                       f"{', '.join(sorted(USD_PER_UNIT))})"))
    if limit is None:
        violations.append(("category", f"{category!r} {RULES['category']} (allowed: "
                                       f"{', '.join(sorted(LIMITS_USD))})"))
    if amount_usd is not None and amount_usd > HARD_CAP_USD:
        violations.append(("cap", f"{amount_usd:.2f} USD {RULES['cap']} ({HARD_CAP_USD:.0f} USD); "
                                  "finance must approve it"))
    elif amount_usd is not None and limit is not None and amount_usd > limit:
        violations.append(("limit", f"{amount_usd:.2f} USD {RULES['limit']} {category} "
                                    f"({limit:.0f} USD)"))
    description = str(claim["description"]).lower()
    if len(description.split()) < MIN_DESCRIPTION_WORDS:
        violations.append(("description", f"{RULES['description']} {MIN_DESCRIPTION_WORDS} words to "
                                          "justify the expense"))
    if category == "meals" and any(word in description for word in ALCOHOL):
        violations.append(("alcohol", f"{RULES['alcohol']} on meals"))
    return amount_usd, limit, violations


def policy(state: ExpenseState) -> dict[str, Any]:
    """The rule gate: the decision is made here, before the model is asked anything."""
    amount_usd, limit, violations = check_policy(dict(state))
    return {
        "amount_usd": amount_usd,
        "limit_usd": limit,
        "rules": sorted(rule for rule, _ in violations),
        "violations": [sentence for _, sentence in violations],
        "decision": "reject" if violations else "approve",
    }


purpose = llm_node(
    "purpose",
    output_key="purpose",
    span_of="{description}",
    none="none",
    params={"max_tokens": 16},
    prompt="Expense claim: {amount} {currency}, {category}.\nDescription: {description}\n"
    "Copy the words of the description that say what was bought or paid for:",
)


def explain(state: ExpenseState) -> dict[str, Any]:
    """The explanation and the reasons, from the rules that decided."""
    what = state.get("purpose") or state["description"].strip()
    claim = f"The {state['amount']:g} {state['currency'].upper()} claim for \"{what}\""
    if state["decision"] == "approve":
        within = (f"{state['amount_usd']:.2f} USD is within the {state['category'].strip().lower()} "
                  f"limit of {state['limit_usd']:.0f} USD")
        reasons = [within, "the description justifies the expense"]
        return {"rationale": f"{claim} is approved: {within}.", "reasons": reasons}
    reasons = list(state["violations"])
    return {"rationale": f"{claim} is rejected: {'; '.join(reasons)}.", "reasons": reasons}


def build() -> StateGraph:
    builder = StateGraph(ExpenseState)
    builder.add_node("policy", policy)
    builder.add_node(purpose)
    builder.add_node("explain", explain)
    builder.add_edge(START, "policy")
    builder.add_edge("policy", "purpose")
    builder.add_edge("purpose", "explain")
    builder.add_edge("explain", END)
    return builder


def workflow() -> Workflow:
    return Workflow.define(
        "expense-approval",
        build,
        ExpenseInput,
        description="Check an expense claim against the policy rules and explain the "
        "approve/reject decision, citing the rules.",
    )
