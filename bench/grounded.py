"""Grounded workloads: replies that copy their input, at batch 1 through the engine.

Code edits (with the original file as the prediction, and without), extraction and quotation,
reformatting, question answering over passages, an agent loop whose requests repeat tool-call
JSON, open chat as the control, and the code edits once more with each request predicting the
reply plain decoding gives it (``CEILING``: where a reply follows its prediction), each decoded
greedily by plain decoding (``--drafter none``, no prediction), the default drafter (``auto``)
and the source it did not choose of the two it chooses between (the copy sources alone,
``suffix``, or the draft model, ``model``), on the embedded pair, with the target's weights as
``LLM()`` loads them by default (on CPUs its Q4_1 file) and in bf16 (``quantization="none"``),
each against plain decoding of the same weights. The setups take turns workload by workload
within each repeat (the order rotating every repeat), so a slow stretch of a shared machine
falls on all of them alike. Each request decodes in a cache scope of its own (``cache_salt``),
so none copies an earlier request's reply from the recent-output index or reuses its prompt's
KV; the agent loop's requests share one scope per run, since repeating replies across requests
is that workload's point. Reported per workload and setup: the median over repeats of tokens per
second of the workload's prompts, the ratio to plain decoding of the same repeat, the mean
accepted length, and whether every output is plain decoding's token for token. Run from the repo
root on an otherwise idle machine: ``.venv/bin/python bench/grounded.py``; the JSON goes to
docs/bench/grounded.json and docs/BENCHMARKS.md is rendered again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

import bench_docs
from multiguess import LLM, SamplingParams
from multiguess.benchmark import weights_of
from multiguess.provenance import provenance

CODE = """def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        return 0
    return total / count


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
"""
PASSAGE = (
    "The Rhine rises in the Swiss Alps and flows north through Lake Constance, then west along "
    "the border between Switzerland and Germany. At Basel it turns north again, forming part of "
    "the border between France and Germany, before crossing Germany and the Netherlands to the "
    "North Sea. The river is about 1,230 kilometres long. Since Roman times it has been one of "
    "the most important trade routes in Europe, and today barges carry coal, grain and "
    "containers between the port of Rotterdam and the industrial cities of the Ruhr."
)
TABLE = "name,city,age\nAlice,Paris,34\nBob,Berlin,28\nCarla,Madrid,41\nDavid,Rome,37\nEmma,Vienna,25"
TOOL = (
    "You are an agent. Answer every request with exactly one tool call in JSON of the form "
    '{"tool": "search_flights", "arguments": {"origin": ..., "destination": ..., "date": ..., '
    '"passengers": ..., "cabin": "economy"}} and nothing else.'
)
# The file first, in a code block, then the edit asked for, as editor integrations send them.
CODE_EDITS = [
    f"```python\n{CODE}```\n\n{edit} in this file. Output the complete updated file in a code block."
    for edit in ("Rename the variable `total` to `acc`", "Change `return 0` to `return 0.0`")
]
WORKLOADS: dict[str, list[str]] = {
    "code edit": CODE_EDITS,
    "code edit + prediction": CODE_EDITS,
    "extraction": [
        f"Copy the passage below word for word, then stop.\n\n{PASSAGE}",
        f"Quote the sentences of this passage that mention Germany, exactly as written.\n\n{PASSAGE}",
    ],
    "reformatting": [
        f"Convert this CSV to a JSON list of objects with the keys name, city and age.\n\n{TABLE}",
        f"Convert this CSV to a Markdown table.\n\n{TABLE}",
    ],
    "qa over passages": [
        f"Passage: {PASSAGE}\n\nQuestion: Where does the Rhine rise and where does it end? "
        "Answer with quotes from the passage.",
        f"Passage: {PASSAGE}\n\nQuestion: What do barges carry on the Rhine today? Quote the passage.",
    ],
    "agent loop": [
        f"{TOOL}\n\nRequest: {who} from {origin} to {destination} on {day} May."
        for who, origin, destination, day in zip(
            ["two people", "one person", "three people", "two people"] * 4,
            ["Paris", "Berlin", "Paris", "Madrid", "Vienna", "Rome", "Lisbon", "Oslo"] * 2,
            ["Lisbon", "Lisbon", "Rome", "Lisbon", "Berlin", "Madrid", "Paris", "Rome"] * 2,
            [12, 14, 12, 20, 3, 8, 17, 25, 5, 9, 21, 28, 2, 11, 16, 30],
            strict=True,
        )
    ],
    "open chat": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a child why the sky is blue.",
    ],
}
SETUPS = {"plain": "none", "default": "auto", "model": "model", "suffix": "suffix"}
MAX_TOKENS = 160  # per reply, at batch 1 and under load (grounded_load.py): long enough to copy a passage
PREDICTIONS = {"code edit + prediction": CODE}  # the text each workload's requests predict
# The code edits again, each predicting the reply plain decoding of the same weights gives it:
# the speed-up where a whole reply follows its prediction (the code edits' replies follow the
# file, then explain it in words the file cannot predict). At batch 1 only.
CEILING = bench_docs.GROUNDED_CEILING
# Workloads whose requests share one cache scope, as one client's do: the agent loop's replies
# repeat across its requests through the recent-output index. Every other request decodes in a
# scope of its own, so none copies another's reply (two prompts of a workload may have the same
# reply, and a load run sends each prompt many times).
SHARED = {"agent loop"}


def cache_salts(workload: str, run: str, requests: int) -> list[str]:
    """The ``cache_salt`` of each of a run's requests of ``workload``: one for the whole run
    where its requests share a scope (``SHARED``), else one per request; ``run`` names the run."""
    if workload in SHARED:
        return [f"{run}-{workload}"] * requests
    return [f"{run}-{workload}-{i}" for i in range(requests)]


def chat(llm: LLM, prompt: str) -> list[int]:
    """The prompt as one user message in the target's chat template, as the API sends it."""
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return llm.tokenizer.encode(text, add_special_tokens=False)


def chosen(llm: LLM) -> str:
    """The setup ``llm``'s default drafter drafts as: the copy sources alone or the draft model."""
    from multiguess.engine.drafters.suffix import SuffixDrafter

    return "suffix" if isinstance(llm.engine.drafter, SuffixDrafter) else "model"


def run_workload(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams,
    salts: list[str],
    predictions: list[str | None],
) -> dict:
    """Every prompt of a workload, one at a time, each in the cache scope of its salt and with
    its prediction: total tokens, seconds, outputs, accepted length."""
    tokens = seconds = steps = accepted = 0
    outputs = []
    for prompt, salt, predicted in zip(prompts, salts, predictions, strict=True):
        start = time.perf_counter()
        out = llm.generate(prompt, replace(params, cache_salt=salt, prediction=predicted))[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        steps += out.stats["verify_steps"]
        accepted += out.stats["accepted_tokens"]
        outputs.append(out.token_ids)
    return {"tokens": tokens, "seconds": seconds, "outputs": outputs, "mal": 1 + accepted / max(1, steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument(
        "--quantization",
        default="auto,none",
        help="the target's weights, each a set of setups: auto (LLM()'s default: the Q4_1 file on "
        "CPUs), none (bf16)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs"), help="docs folder: bench/ JSON and BENCHMARKS.md"
    )
    args = parser.parse_args()
    defaults = {q: LLM(max_batch=1, quantization=q) for q in args.quantization.split(",")}
    picked = {q: chosen(llm) for q, llm in defaults.items()}
    setups = [(q, name) for q in defaults for name in SETUPS if name != picked[q]]
    llms = {
        (q, name): defaults[q]
        if name == "default"
        else LLM(drafter=SETUPS[name], max_batch=1, quantization=q)
        for q, name in setups
    }
    weights = {q: weights_of(llms[q, "plain"].engine.target.model) for q, _ in setups}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    prompts = {w: [chat(llms[setups[0]], p) for p in ps] for w, ps in WORKLOADS.items()}
    prompts[CEILING] = prompts["code edit"]
    for llm in llms.values():  # warm up kernels and caches on a prompt outside the set
        llm.generate(chat(llm, "Say hello."), SamplingParams(max_tokens=8, temperature=0))
    predictions = {(w, q): [PREDICTIONS.get(w)] * len(ids) for w, ids in prompts.items() for q in defaults}
    for q in defaults:
        replies = llms[q, "plain"].generate(prompts[CEILING], params)
        predictions[CEILING, q] = [reply.outputs[0].text for reply in replies]
    runs: dict[str, dict[tuple[str, str], list[dict]]] = {w: {s: [] for s in setups} for w in prompts}
    for repeat in range(args.repeats):
        order = setups[repeat % len(setups) :] + setups[: repeat % len(setups)]
        for workload, ids in prompts.items():
            for setup in order:
                predicted = predictions[workload, setup[0]] if setup[1] != "plain" else [None] * len(ids)
                salts = cache_salts(workload, str(repeat), len(ids))
                runs[workload][setup].append(run_workload(llms[setup], ids, params, salts, predicted))
                print(repeat, *setup, workload, round(runs[workload][setup][-1]["seconds"], 2), flush=True)
    rows = []
    for workload, by_setup in runs.items():
        for (q, name), results in by_setup.items():
            plain = by_setup[q, "plain"]
            rates = [r["tokens"] / r["seconds"] for r in results]
            ratios = [p["seconds"] / r["seconds"] for p, r in zip(plain, results, strict=True)]
            rows.append(
                {
                    "workload": workload,
                    "weights": weights[q],
                    "setup": name,
                    "drafter": f"auto: {picked[q]}" if name == "default" else SETUPS[name],
                    "tokens_per_second": round(statistics.median(rates), 2),
                    "vs_plain": round(statistics.median(ratios), 3),
                    "ratios": [round(r, 3) for r in ratios],
                    "mean_accepted_length": round(statistics.median(r["mal"] for r in results), 2),
                    "identical_to_plain": all(
                        r["outputs"] == p["outputs"] for p, r in zip(plain, results, strict=True)
                    ),
                    "tokens": results[0]["tokens"],
                }
            )
    report = {
        **provenance(),
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "batch": 1,
        "rows": rows,
    }
    path = args.out / "bench" / bench_docs.GROUNDED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(rows, indent=1))
    bench_docs.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
