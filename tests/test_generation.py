"""Vanilla generation: sampling maths, seeds, stop conditions, streaming and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from elesium.inference.sampling import Sampler, SamplingParams, sample_from, target_probs


def test_target_probs_top_k_and_top_p_match_definition():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    probs = target_probs(logits, params)
    ref = torch.softmax(logits / 0.5, -1)
    ref[4] = 0.0  # outside top-4
    ref = ref / ref.sum()
    order = ref.argsort(descending=True)
    keep, mass = [], 0.0
    for i in order.tolist():
        if mass >= 0.9:
            break
        keep.append(i)
        mass += float(ref[i])
    expected = torch.zeros_like(ref)
    expected[keep] = ref[keep]
    expected /= expected.sum()
    assert torch.allclose(probs, expected, atol=1e-6)


def test_sample_from_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    sampler = Sampler(123)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample_from(probs, sampler.uniform())] += 1
    assert counts[1] == 0
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(max_tokens=0),
                                    dict(top_k=-1)])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_same_seed_same_tokens(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234)
    a = engine.generate("Tell me a short story about a robot.", params, mode="vanilla")
    b = engine.generate("Tell me a short story about a robot.", params, mode="vanilla")
    c = engine.generate("Tell me a short story about a robot.",
                        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=99), mode="vanilla")
    assert a.token_ids == b.token_ids and a.seed == 1234
    assert a.token_ids != c.token_ids


def test_stream_chunks_add_up_and_stop_strings_cut(engine):
    params = SamplingParams(max_tokens=40)
    full = engine.generate("Count from 1 to 20, separated by commas.", params, mode="vanilla")
    assert "5" in full.text
    stream = engine.stream("Count from 1 to 20, separated by commas.",
                           SamplingParams(max_tokens=40, stop=("5",)),
                           mode="vanilla")
    chunks = list(stream)
    result = stream.result
    assert "".join(c.text for c in chunks) == result.text
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.index("5")]


def test_text_stream_holds_back_partial_stop(weights):
    from elesium.inference.text_stream import TextStream

    tok = weights.tokenizer
    stream = TextStream(tok, stop=("END",))
    out = "".join(stream.push(t) for t in tok.encode("abc EN"))
    assert out == "abc " and not stream.stopped  # "EN" may still become "END"
    out += "".join(stream.push(t) for t in tok.encode("D more"))
    assert stream.stopped and stream.text == "abc " and out == "abc "


def test_prompt_longer_than_context_is_rejected(engine):
    from elesium.inference.engine import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="this model's context is"):
        engine.generate("word " * 3000, SamplingParams(max_tokens=4))


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from elesium.cli import main

    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_generate_json(capsys):
    code, out, _ = run_cli(["generate", "What is the capital of France?", "--json", "--max-tokens", "16",
                            "--device", "cpu", "--mode", "vanilla"], capsys)
    assert code == 0
    data = json.loads(out)
    assert {"text", "token_ids", "new_tokens", "elapsed_s", "tokens_per_s"} <= data.keys()
    assert "Paris" in data["text"] and data["new_tokens"] == len(data["token_ids"])


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.2"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "model not found"),
    (["generate", "word " * 9000, "--device", "cpu"], "this model's context is"),
])
def test_cli_bad_input_is_one_line_exit_1(capsys, args, message):
    code, out, err = run_cli(args, capsys)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("elesium: error: ") and message in err
