"""Answer a product review: the README's "Write your own workflow" example, as a module a project serves.

``langgraph.json`` names :func:`workflow`, which fits the sentiment probe on first use (seconds, on the
default engine) into ``review-sentiment.json`` beside this file, then registers the graph. Fit it ahead
of serving with ``python review_reply.py``.
"""

from pathlib import Path

from langgraph.graph import END, START, StateGraph
from pydantic import BaseModel

from elesium.graphs import Workflow, WorkflowState, llm_node
from elesium.graphs.classifier import classifier_node, fit_node_probe


class Review(BaseModel):  # the workflow's input, validated before anything runs
    product: str
    text: str


class ReviewState(WorkflowState, total=False):  # WorkflowState counts each node's LLM calls
    product: str
    text: str
    sentiment: str
    reply: str


# A closed-set question goes to a probe on the model's hidden states, fitted on labelled examples.
sentiment = classifier_node("sentiment", prompt="Review of a {product}: {text}", output_key="sentiment",
                            labels=["positive", "negative"],
                            probe=Path(__file__).resolve().with_name("review-sentiment.json"))
REPLIES = {"positive": ["Thank you for the kind words!", "We are glad you enjoy it."],
           "negative": ["We are sorry it let you down.", "Sorry to hear that; our support team will help."]}


def build() -> StateGraph:
    builder = StateGraph(ReviewState)
    builder.add_node(sentiment)
    # The model picks the reply among those that fit the sentiment, under a grammar: never off-tone.
    builder.add_node(llm_node("reply", output_key="reply", choices_of=lambda s: REPLIES[s["sentiment"]],
                              params={"max_tokens": 24, "temperature": 0.7},
                              prompt="A customer reviewed our {product}: {text}\nHow do we answer?"))
    builder.add_edge(START, "sentiment")
    builder.add_edge("sentiment", "reply")
    builder.add_edge("reply", END)
    return builder


LABELLED = [
    ("Works perfectly, very happy with it.", "positive"), ("Broke after two days.", "negative"),
    ("Fast, quiet and easy to clean.", "positive"), ("Leaks water all over the counter.", "negative"),
    ("Best purchase this year, highly recommend.", "positive"), ("Too loud and the lid sticks.", "negative"),
    ("Great value for the price.", "positive"), ("Arrived scratched and smells of plastic.", "negative"),
    ("My whole family loves it.", "positive"), ("Stopped working, waste of money.", "negative"),
    ("Looks lovely in our kitchen.", "positive"), ("The handle gets dangerously hot.", "negative"),
]


def fit_probe(engine=None) -> Path:  # noqa: ANN001 - an Engine; imported only when fitting
    """Fit the sentiment probe on :data:`LABELLED` (a refit changes the workflow's version)."""
    if engine is None:
        from elesium.inference.engine import Engine

        engine = Engine.load()
    rows = [{"input": {"product": "kettle", "text": t}, "expected": {"sentiment": s}} for t, s in LABELLED]
    fit_node_probe(engine, sentiment, rows).save(sentiment.probe_path)
    return sentiment.probe_path


def workflow() -> Workflow:
    """The registered workflow (input validation, versioned runs); fits the probe the first time."""
    if not sentiment.probe_path.exists():
        fit_probe()
    return Workflow.define("review-reply", build, Review, description="Answer a product review.")


if __name__ == "__main__":
    print(f"fitted {fit_probe()}")
