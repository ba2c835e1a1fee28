"""The tree, step by step: a call's decoding as the console shows it, recorded or live.

Each verification step drafted a tree (node 0 is the token chosen before the step; every other node
a head's draft under its parent), verification accepted a path from the root, and the base model drew
one more token after the path's last node (the step's last committed token). A run that records trees
(``configurable.record_trees``, ``Workflow.define(record_trees=True)``, ``elesium run --record-trees``)
keeps every node with its draft probability; without it the acceptance log still holds the accepted
path, its tokens and the bonus token, which is what the page then shows.

The recorded view is rendered by the server, one step per page (``?step=N``, links to step back and
forward). The live view decodes a prompt on this server's engine with tree recording on and streams
each step as it is verified (server-sent events over a POST: the session's CSRF token travels in a
header, which ``EventSource`` cannot send); each step's tree is the same server-rendered fragment as
on the recorded page. Live decoding spends engine time, so it needs what a chat completion needs
(``ROUTE_ROLES``, ``operator``), and its length is bounded (:data:`LIVE_MAX_TOKENS`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from elesium.api.console import pages
from elesium.api.console.views import MAX_DEPTH_CLASS
from elesium.api.events import RunChannel
from elesium.api.routers.common import follow_until_disconnect, services

LIVE_MAX_TOKENS = 64
"""The most new tokens a live decode may ask for (the engine is shared with runs and completions)."""
LIVE_MAX_PROMPT_CHARS = 2000


# ---------------------------------------------------------------- the data one step shows
def _text(tokenizer: Any, token: int) -> str:
    return f"[{token}]" if tokenizer is None else tokenizer.decode([int(token)])


def _shown(text: str) -> str:
    """A token's text with its whitespace shown (a node holding a space or a newline must not look empty)."""
    return text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5") or "\u2205"


def step_view(record: Any, root: int, index: int, tau: float, tokenizer: Any) -> dict[str, Any]:
    """One step for the page: its tree (every node if recorded, else the accepted path), the accepted
    path, the base model's token after it, and the running τ.

    ``record``: a logged step (``LoggedStep``) or the engine's ``StepRecord``: the same fields.
    ``root``: the token the step started from (the previous step's last token, or the prefill's).
    """
    accepted = list(record.accepted_nodes)
    tokens = list(record.tokens)
    tree = getattr(record, "tree", None)
    if tree is not None:
        ids, parents, probs = list(tree.tokens), list(tree.parents), list(tree.probs)
    else:  # only the accepted path is in the log: node ids from it, tokens from the committed ones
        ids = [root] + tokens[:len(accepted) - 1]
        parents = [-1] + accepted[:-1]
        probs = [1.0] + [None] * (len(accepted) - 1)
    index_of = {node: i for i, node in enumerate(accepted if tree is None else range(len(ids)))}
    on_path = set(accepted)
    nodes: list[dict[str, Any]] = []
    for i, token in enumerate(ids):
        node = accepted[i] if tree is None else i
        parent = parents[i]
        depth = 0 if parent < 0 else nodes[index_of[parent]]["depth"] + 1
        text = _text(tokenizer, token)
        nodes.append({"id": node, "parent": parent, "depth": depth, "token": int(token), "text": text,
                      "shown": _shown(text), "prob": probs[i], "accepted": node in on_path, "children": []})
    for n in nodes[1:]:
        nodes[index_of[n["parent"]]]["children"].append(n)
    bonus = tokens[-1]
    return {
        "index": index,
        "recorded": tree is not None,
        "root": nodes[0],
        "flat": nodes,
        "size": record.tree_size,
        "depth": record.tree_depth,
        "accepted": accepted,
        "accepted_length": record.accepted_length,
        "path_text": [_text(tokenizer, t) for t in tokens[:-1]],
        "bonus": {"token": bonus, "text": _text(tokenizer, bonus), "shown": _shown(_text(tokenizer, bonus)),
                  "after": accepted[-1]},
        "tau": tau,
        "elapsed_ms": round(float(record.elapsed_s) * 1000, 1),
    }


def call_steps(entries: Sequence[Any], node: str, call: int, tokenizer: Any) -> dict[str, Any] | None:
    """Every step of one LLM call (node, call index) of a run, from its acceptance entries; None if the
    log has no such call."""
    head = None
    steps: list[Any] = []
    for e in entries:
        if e.node_id != node or e.call_index != call:
            continue
        if e.kind == "call":
            head = e
        elif head is not None:
            steps.append(e.record)
    if head is None:
        return None
    root = head.record.tokens[-1] if head.record.tokens else -1
    views, committed = [], 0
    for i, record in enumerate(steps):
        committed += record.accepted_length
        views.append(step_view(record, root, i, committed / (i + 1), tokenizer))
        root = record.tokens[-1]
    return {"node": node, "call": call, "seed": head.call_seed, "mode": head.record.mode,
            "temperature": head.temperature, "steps": views,
            "recorded": any(s["recorded"] for s in views), "tokens": len(head.tokens or ())}


# ---------------------------------------------------------------- the recorded view
def tree_page(request: Request) -> Response:
    p = request.path_params
    thread_id, run_id, node = p["thread_id"], p["run_id"], p["node"]
    session = pages._session(request)
    if session is None:
        return pages._to_login(request)
    who = pages._principal_of(request, session)
    if (refused := pages._refused(request, session, who)) is not None:
        return refused
    svc = services(request)
    try:
        call = int(p["call"])
        row = svc.run_or_404(thread_id, run_id, who)
        data = call_steps(list(svc.acceptance.iter_entries(row.run_id)), node, call,
                          getattr(svc.engine, "tokenizer", None))
        if data is None:
            raise LookupError
    except Exception:  # noqa: BLE001 - any unknown run, call or bad index is the same 404 page
        return pages._page(request, "error.html", code=404, session=session, who=who, title="Call not found",
                            message=f"No LLM call {node} #{p['call']} in run {run_id} for your tenant.")
    steps = data["steps"]
    try:
        at = int(request.query_params.get("step", "0"))
    except ValueError:
        at = 0
    at = max(0, min(at, len(steps) - 1)) if steps else 0
    base = f"{pages._run_url(thread_id, run_id)}/calls/{quote(node, safe='')}/{call}"
    return pages._page(request, "tree.html", session=session, who=who, call=data,
                        step=steps[at] if steps else None, at=at, count=len(steps), base=base,
                        run_url=pages._run_url(thread_id, run_id), run_id=run_id)


# ---------------------------------------------------------------- the live view
def live_page(request: Request) -> Response:
    session = pages._session(request)
    if session is None:
        return pages._to_login(request)
    who = pages._principal_of(request, session)
    engine = services(request).engine
    return pages._page(request, "live.html", session=session, who=who, max_tokens=LIVE_MAX_TOKENS,
                        allowed=_may_decode(who), speculative="speculative" in engine.modes)


def _may_decode(who: Any) -> bool:
    """What a chat completion needs (the API's role table), since this decodes on the same engine."""
    from elesium.api.auth import allows_any, route_role

    need = route_role("POST", "/v1/chat/completions") or "operator"
    return not hasattr(who, "allows") or allows_any(who, need)


def _live_request(body: Any) -> tuple[str, int, float, int | None]:
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str) or not body["prompt"].strip():
        raise ValueError("send JSON: {prompt: string, max_tokens?: 1..%d, temperature?: 0..2, seed?: int}"
                         % LIVE_MAX_TOKENS)
    prompt = body["prompt"]
    if len(prompt) > LIVE_MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt is {len(prompt):,} characters; the live view takes up to "
                         f"{LIVE_MAX_PROMPT_CHARS:,}")
    max_tokens = body.get("max_tokens", 32)
    if type(max_tokens) is not int or not 1 <= max_tokens <= LIVE_MAX_TOKENS:
        raise ValueError(f"max_tokens must be an integer from 1 to {LIVE_MAX_TOKENS}")
    temperature = body.get("temperature", 0.0)
    if type(temperature) not in (int, float) or not 0 <= temperature <= 2:
        raise ValueError("temperature must be a number from 0 to 2")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise ValueError("seed must be an integer in [0, 2**63)")
    return prompt, max_tokens, float(temperature), seed


async def live_stream(request: Request) -> Response:
    """POST {prompt, max_tokens, temperature?, seed?} -> ``text/event-stream``: ``start``, a ``step`` per
    verification step (its tree fragment, committed tokens, τ so far), then ``done`` or ``error``."""

    session = await pages._action_session(request, changes_state=True)
    if isinstance(session, JSONResponse):
        return session
    who = pages._principal_of(request, session)
    if not _may_decode(who):
        return JSONResponse({"detail": "live decoding needs the 'operator' role (what a chat completion "
                             "needs); this API key does not have it"}, status_code=403)
    try:
        prompt, max_tokens, temperature, seed = _live_request(await request.json())
    except ValueError as exc:
        return JSONResponse({"detail": str(exc).splitlines()[0] or "send JSON"}, status_code=422)
    svc = services(request)
    if "speculative" not in svc.engine.modes:
        return JSONResponse({"detail": "this server's engine has no draft heads: there is no tree to show "
                             "(start it with heads, or see the runs' pages)"}, status_code=409)
    channel = RunChannel()
    svc.worker.submit(lambda: _decode(svc.engine, prompt, max_tokens, temperature, seed, channel))
    events = follow_until_disconnect(request, channel, on_disconnect=channel.cancel.set)
    return StreamingResponse(_frames(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _decode(engine: Any, prompt: str, max_tokens: int, temperature: float, seed: int | None,
            channel: RunChannel) -> None:
    """On the engine thread: decode with tree recording on, publishing each step as it is verified."""
    from elesium.inference.sampling import SamplingParams
    from elesium.inference.types import GenerationRequest

    tokenizer = getattr(engine, "tokenizer", None)
    fragment: Any = pages.TEMPLATES.get_template("_tree.html").module  # the template's macros, e.g. step()
    stream = None
    finished = False
    try:
        if channel.cancel.is_set():
            return
        policy = dataclasses.replace(engine.policy, record_trees=True)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        steps: list[Any] = []
        stream = engine.start(GenerationRequest(prompt, params, mode="speculative", policy=policy),
                              on_step=steps.append)
        root, committed, sent = -1, 0, 0

        def flush() -> None:
            nonlocal root, committed, sent
            for record in steps[sent:]:
                committed += record.accepted_length
                view = step_view(record, root, sent, committed / (sent + 1), tokenizer)
                last = len(record.tokens) - 1
                channel.publish("step", {
                    "index": sent, "tau": round(view["tau"], 3), "html": str(fragment.step(view)),
                    "tokens": [{"id": t, "text": _text(tokenizer, t),
                                "depth": min(j + 1, MAX_DEPTH_CLASS) if j < last else 0}
                               for j, t in enumerate(record.tokens)]})
                root, sent = record.tokens[-1], sent + 1

        for chunk in stream:
            if channel.cancel.is_set():
                return
            if sent == 0 and not steps and chunk.token_ids:  # the prefill's token: the first step's root
                root = chunk.token_ids[-1]
                channel.publish("start", {"token": root, "text": _text(tokenizer, root)})
            flush()
        flush()
        finished = True
        gen = stream.result
        channel.publish("done", {"text": gen.text, "steps": len(gen.steps), "tokens": gen.new_tokens,
                                 "tau": round(gen.mean_accepted, 3), "finish_reason": gen.finish_reason,
                                 "seed": gen.seed})
    except Exception as exc:  # noqa: BLE001 - the headers are sent: report in-stream
        channel.publish("error", {"detail": f"{type(exc).__name__}: {exc}"})
    finally:
        if stream is not None and not finished and hasattr(stream, "close"):
            stream.close()  # releases the engine at once
        channel.close()


async def _frames(events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[bytes]:
    async for kind, data in events:
        yield f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
