"""``multiguess bench``: the speed benchmark (see ``multiguess.benchmark``). It writes its raw
result (JSON) and a plot under ``--out``; the repository's ``make bench-docs`` renders
docs/BENCHMARKS.md and the README's table from them."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from multiguess.commands.engine_args import add_engine_args, configure_threads, engine_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark against plain and HF assisted generation")
    add_engine_args(parser)
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompt set")
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    parser.add_argument("--chain-depth", type=int, default=None, help="depth for the chain run")
    parser.add_argument("--skip-assisted", action="store_true", help="leave out HF assisted generation")
    parser.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled runs")
    parser.add_argument(
        "--head",
        type=Path,
        default=None,
        help="an EAGLE-3 head drafting the same tree in the same run (default: the embedded "
        "target's shipped head, when one ships and --target is not given)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs"), help="where results go")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from multiguess import benchmark as bm
    from multiguess.drafting import DraftOptions, build_drafter
    from multiguess.engine.engine import Engine
    from multiguess.llm import load_pair
    from multiguess.models.loading import load_model
    from multiguess.provenance import provenance

    configure_threads(args.threads)
    target, draft = load_pair(
        args.target,
        args.draft,
        args.dtype,
        args.device,
        args.draft_device,
        args.draft_quantization,
        draft_dtype=args.draft_dtype,
        quantization=args.quantization,
    )
    if draft is None:
        print("error: the benchmark needs a draft (--draft)", file=sys.stderr)
        return 2
    version, prompt_set = bm.load_prompts()
    if args.prompts:
        prompt_set = prompt_set[: args.prompts]
    tokenizer = target.tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in prompt_set
    ]
    n = args.max_tokens
    # Each repeat serves the same prompts again: a prefix cache would skip the prefill of
    # multiguess's methods only, and the ratios to transformers would no longer be like for like.
    tree_cfg = engine_config(args, max_batch=1, prefix_caching=False)
    chain_cfg = replace(tree_cfg, num_candidates=1, depth=args.chain_depth or args.depth)
    results = {name: bm.MethodResult(name, sampled="sampled" in name) for name in bm.METHODS}
    shared = DraftOptions(loaded=draft)  # every engine's draft model drafts with the same weights
    tree_engine = Engine(target, build_drafter("model", target, shared), tree_cfg)
    plain_engine = Engine(target, None, tree_cfg)
    generators = {
        "transformers generate": bm.hf_generator(target, n),
        "transformers assisted": bm.hf_generator(target, n, draft),
        "multiguess plain": bm.engine_generator(plain_engine, n, results["multiguess plain"]),
        "multiguess plain, sampled": bm.engine_generator(
            plain_engine, n, results["multiguess plain, sampled"], args.temperature
        ),
        "multiguess chain": bm.engine_generator(
            Engine(target, build_drafter("model", target, shared), chain_cfg), n, results["multiguess chain"]
        ),
        "multiguess tree": bm.engine_generator(tree_engine, n, results["multiguess tree"]),
        "multiguess tree, sampled": bm.engine_generator(
            tree_engine, n, results["multiguess tree, sampled"], args.temperature
        ),
    }
    head = benchmark_head(args.head, args.target)
    if head is not None:
        eagle3_engine = Engine(target, build_drafter("eagle3", target, DraftOptions(str(head))), tree_cfg)
        generators["multiguess eagle3 tree"] = bm.engine_generator(
            eagle3_engine, n, results["multiguess eagle3 tree"]
        )
        generators["multiguess eagle3 tree, sampled"] = bm.engine_generator(
            eagle3_engine, n, results["multiguess eagle3 tree, sampled"], args.temperature
        )
    if args.skip_assisted:
        del generators["transformers assisted"]
    results = {name: results[name] for name in generators}
    methods = {name: (generators[name], results[name]) for name in generators}
    total = args.repeats * len(prompts) * len(methods)
    with tqdm(total=total, desc="bench", file=sys.stderr) as bar:
        bm.run_methods(methods, prompts, args.repeats, lambda msg: (bar.set_postfix_str(msg), bar.update()))

    print("measuring plain steps against the bandwidth bound, and verification cost ...", file=sys.stderr)
    weights = bm.weight_bytes(target.model)
    bound = bm.step_against_bound(plain_engine, prompts[0], weights)
    sizes = (1, 2, 4, 8, 16, 32)
    verify = {str(target.dtype).removeprefix("torch."): bm.verify_cost(target, sizes, prompts[0])}
    if target.dtype != torch.float32:
        fp32 = load_model(target.name, dtype="float32", device=args.device)
        verify["float32"] = bm.verify_cost(fp32, sizes, prompts[0])
    reference = results["transformers generate"]
    assisted = results.get("transformers assisted")
    report = {
        "prompt_set_version": version,
        "prompts": len(prompts),
        "max_tokens": n,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "dtype": str(target.dtype).removeprefix("torch."),
        "target": target.name,
        "draft": draft.name,
        "eagle3_head": str(head) if head is not None else None,
        "quantization": args.quantization,
        "draft_quantization": args.draft_quantization,
        "tree": {"num_candidates": args.num_candidates, "depth": args.depth, "max_nodes": args.max_nodes},
        "chain_depth": chain_cfg.depth,
        "adaptive": tree_cfg.adaptive,
        "kernels": tree_engine.target.backend.label,
        **provenance(),
        "methods": [r.as_dict(reference, assisted, results["multiguess plain"]) for r in results.values()],
        "weight_bytes": weights,
        "bandwidth_gb_s": bound.bandwidth_gb_s,
        "plain_step_ms": bound.step_ms,
        "generate_step_ms": round(1000 / reference.median_tps, 2),
        "bandwidth_bound_step_ms": bound.bound_ms,
        "step_over_bound": bound.ratio,
        "verify_cost_ms": verify,
    }
    write_report(report, args.out)
    print(bm.markdown_report(report))
    return 0


def benchmark_head(head: Path | None, target: str | None) -> Path | None:
    """The head to measure: the one asked for, else the embedded target's when one ships."""
    from multiguess.models.eagle3_checkpoint import SHIPPED_HEAD, is_eagle3_folder

    if head is not None:
        return head
    return SHIPPED_HEAD if target is None and is_eagle3_folder(SHIPPED_HEAD) else None


def write_report(report: dict, out: Path) -> None:
    """The run's JSON (``out/bench/results-<dtype>.json``) and plot (``out/img/bench-<dtype>.png``).

    Each dtype has its own files and section, so a float32 run (bit-exact greedy output) and a
    bfloat16 run (speed) are reported side by side."""
    from multiguess import benchmark as bm

    dtype = report["dtype"]
    (out / "bench").mkdir(parents=True, exist_ok=True)
    (out / "img").mkdir(parents=True, exist_ok=True)
    (out / "bench" / f"results-{dtype}.json").write_text(json.dumps(report, indent=2) + "\n")
    bm.plot_report(report, out / "img" / f"bench-{dtype}.png")
