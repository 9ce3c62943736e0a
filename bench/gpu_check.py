"""`make gpu-check`: the CUDA path checked and measured by one prepared command.

Needs one GPU, torch and transformers, and the tree on ``PYTHONPATH`` (``server``): no network,
no FastAPI, pytest or scipy, nothing installed. Versions older than the code needs, or a
missing Triton or C compiler (FlexAttention's CUDA kernels are compiled), stop it before
anything runs, naming what needs them. It prints one table and writes
``gpu_check.json`` (with the commit; the table as ``gpu_check.md``) to ``$OUT`` when set, else
``--out``. Identity is judged in float32 with TF32 off; bf16 is used only for speed. On CUDA
every engine run happens under ``sdpa_kernel`` without the math kernel, so an attention call
that would fall back to it fails its section.

- (a) lossless: speculative greedy decoding (tree, chain, n-gram; batch 1 and batched) against
  plain decoding token for token in float32, and sampled speculation, seeded and unseeded,
  against the exact distribution of a tiny-vocabulary model (chi-square, its p-value from
  torch's ``gammaincc``), which must reject the draft's own;
- (b) speed: transformers ``generate`` and assisted generation against multiguess plain, chain
  and tree, at batch 1 and batched, on random-weight Llama shapes built on the device (a ~1B
  and an ~8B target; a draft equal to the target accepts every guess and shows the pipeline's
  own cost, a small random draft the cost of drafting), and on the embedded pair where present;
- (c) CUDA graphs against eager (the torch backend's eager forwards): identical tokens in
  float32 (greedy and seeded sampling), tokens/s in the benchmark dtype, plain and tree, at
  batch 1 and batched; on the CPU the static forward runs uncaptured, so the dry run checks
  its arithmetic, not its speed;
- (d) the memory plan of an engine left to fill the device, checked against what it allocates;
- (e) long context: an 8B Llama-3.1 shape at ``max_model_len`` 8192, 64 sequences of ragged
  lengths, each prefilled whole, decoding trees together: the plan holds them, the peak stays
  inside it, and masked attention at that length runs fused;
- (f) the versions, ``--dtype auto``'s choice, and that nothing reached the CPU family (whose
  first use compiles C kernels) on a CUDA host.

The CUDA tests in ``tests/gpu`` need pytest; their cases are folded in here. Every section
catches its own failure, records it and goes on; a time budget skips what is left once spent.
``--device cpu`` (``make gpu-check DEVICE=cpu``) is a dry run with tiny shapes, part of the
test suite so the check cannot rot. The exit status is 1 when a check failed, 2 when the
versions are too old or no GPU is visible, else 0. The report names the commit measured:
``$GPU_CHECK_COMMIT`` where the tree travels without its git folder, else its git commit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import shutil
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "server"))

import torch  # noqa: E402
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402

# What the code relies on, and why: checked before anything of multiguess is imported.
REQUIRED = {
    "torch": ("2.5", "scaled_dot_product_attention(enable_gqa=) and FlexAttention"),
    "transformers": ("4.56", "_from_config(dtype=) and from_pretrained(dtype=)"),
}


def version_problems(installed: dict[str, str]) -> list[str]:
    """One line per package older than ``REQUIRED`` says, naming what needs it."""
    return [
        f"{name} {installed[name]} is older than {least}, which {why} need"
        for name, (least, why) in REQUIRED.items()
        if Version(Version(installed[name]).base_version) < Version(least)
    ]


INSTALLED = {"torch": torch.__version__, "transformers": transformers.__version__}
if __name__ == "__main__" and version_problems(INSTALLED):
    print("gpu-check: " + "; ".join(version_problems(INSTALLED)), file=sys.stderr)
    sys.exit(2)

from multiguess.engine.backends import backend_for  # noqa: E402
from multiguess.engine.config import EngineConfig  # noqa: E402
from multiguess.engine.drafters.model import ModelDrafter  # noqa: E402
from multiguess.engine.drafters.ngram import NgramDrafter  # noqa: E402
from multiguess.engine.engine import Engine  # noqa: E402
from multiguess.engine.loaded_model import LoadedModel  # noqa: E402
from multiguess.engine.placement import region_attention_mask  # noqa: E402
from multiguess.engine.sampling import Processing, processed_probs  # noqa: E402
from multiguess.errors import EngineConfigError, InsufficientMemoryError  # noqa: E402
from multiguess.models.loading import resolve_dtype  # noqa: E402
from multiguess.params import SamplingParams  # noqa: E402
from multiguess.provenance import git_commit  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

# What a machine with only torch and transformers lacks: the check must not need any of it.
SERVING_ONLY = ("fastapi", "starlette", "uvicorn", "prometheus_client", "pytest")
ALPHA = 1e-3  # chi-square: a correct sampler fails a case once in a thousand runs
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's dimensions."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int = 8192
    tied: bool = False

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            rope_theta=500000.0,
            tie_word_embeddings=self.tied,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        )


LLAMA_1B = Shape("llama-1b", 2048, 8192, 16, 32, 8, 128256, tied=True)
LLAMA_8B = Shape("llama-8b", 4096, 14336, 32, 32, 8, 128256)
SMALL_DRAFT = Shape("draft-70m", 512, 1536, 4, 8, 4, 128256, tied=True)
CHECK_MODEL = Shape("check-model", 256, 512, 4, 8, 4, 1000, max_positions=1024)
TINY_A = Shape("tiny-a", 64, 128, 2, 4, 2, 512, max_positions=512)
TINY_B = Shape("tiny-b", 96, 192, 3, 4, 2, 512, max_positions=512)
TINY_DRAFT = Shape("tiny-draft", 32, 64, 1, 2, 1, 512, max_positions=512)
SAMPLING_MODEL = Shape("sampling-model", 64, 128, 2, 4, 2, len(SPECIALS) + 4, max_positions=64)


@dataclass(frozen=True)
class LongContext:
    """Many sequences near ``max_model_len`` decoding trees together: the memory plan and masked
    attention at long context."""

    target: Shape
    draft: Shape
    max_model_len: int
    sequences: int
    new_tokens: int


@dataclass(frozen=True)
class Profile:
    """What one run checks and measures: the full check on a GPU, tiny shapes in a dry run."""

    device: str
    dtype: torch.dtype
    targets: tuple[Shape, ...]
    draft: Shape
    check_model: Shape
    prompt_len: int
    new_tokens: int
    prompts: int  # at batch 1, one after another
    batch: int  # batched: this many prompts at once
    samples: int  # per sampling case
    sampling_cases: tuple[tuple[str, int, int, str, bool], ...]  # (shape, k, depth, setting, seeded)
    greedy_prompts: int
    greedy_tokens: int
    plan_model: Shape
    long_context: LongContext
    embedded: bool
    budget_s: float


SAMPLING_SETTINGS = {
    "t1": Processing(1.0),
    "t0.7 top-k 3": Processing(0.7, top_k=3),
    "t1 top-p 0.8": Processing(1.0, top_p=0.8),
}


def profile(device: str, budget_s: float | None) -> Profile:
    if device == "cpu":
        return Profile(
            device="cpu",
            dtype=torch.float32,
            targets=(TINY_A,),
            draft=TINY_DRAFT,
            check_model=TINY_A,
            prompt_len=8,
            new_tokens=6,
            prompts=1,
            batch=2,
            samples=400,
            sampling_cases=(("tree", 3, 2, "t1", True), ("tree", 3, 2, "t1", False)),
            greedy_prompts=3,
            greedy_tokens=8,
            plan_model=TINY_B,
            long_context=LongContext(TINY_B, TINY_DRAFT, 160, 4, 6),
            embedded=False,
            budget_s=budget_s or 240,
        )
    return Profile(
        device=device,
        dtype=torch.bfloat16,
        targets=(LLAMA_1B, LLAMA_8B),
        draft=SMALL_DRAFT,
        check_model=CHECK_MODEL,
        prompt_len=128,
        new_tokens=64,
        prompts=3,
        batch=8,
        samples=3000,
        sampling_cases=(
            ("tree", 3, 2, "t1", True),
            ("tree", 3, 2, "t1", False),
            ("tree", 3, 2, "t0.7 top-k 3", False),
            ("chain", 1, 3, "t1 top-p 0.8", False),
        ),
        greedy_prompts=6,
        greedy_tokens=32,
        plan_model=LLAMA_8B,
        long_context=LongContext(LLAMA_8B, SMALL_DRAFT, 8192, 64, 16),
        embedded=True,
        budget_s=budget_s or 360,  # a section started in time may run on past it
    )


class OutOfTime(Exception):
    """The run's time budget is spent: what is left is skipped."""


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise OutOfTime(f"time budget of {self.seconds:.0f} s spent before {what}")


@dataclass
class Section:
    name: str
    status: str = "ok"  # ok, failed, skipped, partial
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)
    note: str = ""

    def row(self, case: str, status: str = "", **values: object) -> dict:
        entry = {"case": case, "status": status, **values}
        self.rows.append(entry)
        return entry


# -- models built on the device ---------------------------------------------------------------
def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly ``vocab`` ids, so every id the model emits decodes."""
    words = {tok: i for i, tok in enumerate(SPECIALS + [f"w{i}" for i in range(vocab - len(SPECIALS))])}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def random_llama(
    shape: Shape, device: str, dtype: torch.dtype, seed: int, sharpen: float = 1.0
) -> LoadedModel:
    """A random-weight Llama of ``shape`` made directly on ``device`` (no host copy, no files)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(shape.config(), dtype=dtype)
    model.to(device).requires_grad_(False).eval()
    if sharpen != 1.0:  # sharper logits: greedy choices are rarely near-ties
        model.lm_head.weight.mul_(sharpen)
    model.generation_config.eos_token_id = None  # generate runs to max_new_tokens, as the engine
    model.generation_config.pad_token_id = 3
    return LoadedModel(model, word_tokenizer(shape.vocab), shape.name, torch.device(device), dtype)


def noisy_copy(source: LoadedModel, noise: float, seed: int) -> LoadedModel:
    """A draft that agrees with ``source`` partly: its weights plus Gaussian noise."""
    config = source.model.config
    with torch.device(source.device):
        model = LlamaForCausalLM._from_config(config, dtype=source.dtype)
    model.load_state_dict(source.model.state_dict())
    model.requires_grad_(False).eval()
    generator = torch.Generator(source.device).manual_seed(seed)
    for param in model.parameters():
        noise_tensor = torch.randn(param.shape, generator=generator, device=source.device, dtype=param.dtype)
        param.add_(noise_tensor * noise * param.float().std().to(param.dtype))
    model.generation_config.eos_token_id = None
    return replace(source, model=model, name=f"{source.name} + noise {noise}")


def exact_float32() -> None:
    """Float32 products without TF32, so two attention paths that differ only in summation
    order agree on every greedy token."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(len(SPECIALS), vocab) for _ in range(length)] for _ in range(count)]


# -- decoding ---------------------------------------------------------------------------------
@dataclass
class Decoded:
    outputs: list[list[int]]
    seconds: float
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_accepted_length(self) -> float | None:
        if not self.draft_tokens:
            return None
        return round(1 + self.accepted_tokens / max(1, self.verify_steps), 3)


def no_math_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, ``scaled_dot_product_attention`` may take the flash, memory-efficient or cuDNN
    kernels but never the math one (which repeats keys and values to every query head and
    upcasts): a call that would fall back to it raises instead. Elsewhere, nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    )


def engine_decode(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, together: bool
) -> Decoded:
    """Every prompt through ``engine``: all at once (``together``) or one after another."""
    groups = [prompts] if together else [[p] for p in prompts]
    seqs, start = [], time.perf_counter()
    with no_math_attention(engine.target.device):
        for group in groups:
            batch = [engine.add_request(f"r{len(seqs) + i}", p, params) for i, p in enumerate(group)]
            while engine.has_unfinished():
                engine.step()
            seqs.extend(batch)
    seconds = time.perf_counter() - start
    result = Decoded([s.output_ids for s in seqs], seconds)
    for seq in seqs:
        result.verify_steps += seq.stats.verify_steps
        result.draft_tokens += seq.stats.draft_tokens
        result.accepted_tokens += seq.stats.accepted_tokens
    return result


def hf_decode(
    target: LoadedModel, prompts: list[list[int]], new_tokens: int, together: bool, assistant=None
) -> Decoded:
    """transformers greedy ``generate`` (assisted with ``assistant``); prompts share one length,
    so a batch needs no padding."""
    extra = {} if assistant is None else {"assistant_model": assistant.model}
    groups = [prompts] if together else [[p] for p in prompts]
    outputs, start = [], time.perf_counter()
    for group in groups:
        ids = torch.tensor(group, device=target.device)
        with torch.inference_mode():
            out = target.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **extra,
            )
        outputs.extend(out[:, ids.shape[1] :].tolist())
    sync(str(target.device))
    return Decoded(outputs, time.perf_counter() - start)


def identical(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(b)}"


def drafting(draft: LoadedModel | None) -> ModelDrafter | None:
    """The draft model's drafter (None: plain decoding)."""
    return None if draft is None else ModelDrafter(draft)


def engine_config(k: int, depth: int, max_batch: int, max_model_len: int, **kw: object) -> EngineConfig:
    return EngineConfig(k, depth, 16, max_batch, max_model_len, adaptive=False, **kw)


# -- (0) fused attention ----------------------------------------------------------------------
def attention_cases(length: int) -> dict[str, tuple]:
    """Each path of the torch backend's attention over ``length`` cached positions: name:
    (the queries' width, each sequence's prefix length, which nodes each node sees, masked)."""
    tree = torch.eye(8, dtype=torch.bool)
    for child, parent in enumerate((-1, 0, 0, 1, 1, 2, 3, 5)):
        if parent >= 0:
            tree[child] |= tree[parent]
    ragged = [length - 9, length // 2, length // 3, 17]
    return {
        "plain decode": (1, [length - 1] * 4, torch.ones(1, 1, dtype=torch.bool), False),
        "causal prefill": (length, [0] * 4, torch.ones(length, length, dtype=torch.bool).tril(), False),
        "tree after ragged prefixes": (8, [p - 8 for p in ragged], tree, True),
        "ragged decode": (1, [p - 1 for p in ragged], torch.ones(1, 1, dtype=torch.bool), True),
    }


def fused_attention(p: Profile, section: Section, budget: Budget) -> None:
    """Every path of the torch backend's attention against float64 SDPA on the CPU, in float32
    (TF32 off) and the benchmark dtype, with an 8B's grouped heads; on CUDA under
    ``sdpa_kernel`` without the math kernel, so a call that would fall back to it fails."""
    exact_float32()
    on_cuda = p.device.startswith("cuda")
    # an 8B's heads; cache lengths that are not a multiple of FlexAttention's 128-key blocks
    heads, kv_heads, dim, length = (32, 8, 128, 1000) if on_cuda else (8, 2, 16, 40)
    tolerances = {p.dtype: 5e-2} | {torch.float32: 1e-4}  # a wrong mask errs by O(1)
    attention = backend_for(torch.device(p.device), p.dtype, eager=False, name="torch").attention
    for name, (width, prefix, visible, masked) in attention_cases(length).items():
        generator = torch.Generator().manual_seed(9)
        q = torch.randn(4, width, heads, dim, generator=generator, dtype=torch.float64)
        keys, values = (
            torch.randn(4, kv_heads, length, dim, generator=generator, dtype=torch.float64) for _ in "kv"
        )
        mask = region_attention_mask(torch.tensor(prefix), visible.expand(4, width, width), length)
        expected = (
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, scale=dim**-0.5, enable_gqa=True
            )
            .transpose(1, 2)
            .reshape(4, width, heads * dim)
        )
        for dtype, tolerance in tolerances.items():
            budget.check(f"attention {name}")
            moved = [t.to(p.device, dtype) for t in (q, keys, values)]
            with no_math_attention(torch.device(p.device)):
                got = attention(*moved, mask.to(p.device) if masked else None, dim**-0.5)
            error = float((got.double().cpu() - expected).abs().max())
            section.row(
                f"{name}, {str(dtype).removeprefix('torch.')}",
                "pass" if error <= tolerance else "FAIL",
                note=f"max error {error:.2e} (tolerance {tolerance:g})",
            )


# -- (a) lossless greedy ----------------------------------------------------------------------
def lossless_greedy(p: Profile, section: Section, budget: Budget) -> None:
    """Speculation against plain decoding of the same engine, in float32 (TF32 off): token for
    token, at batch 1 and batched, for tree, chain and n-gram drafting."""
    exact_float32()
    shape = p.check_model
    target = random_llama(shape, p.device, torch.float32, seed=1, sharpen=8.0)
    draft = noisy_copy(target, noise=0.3, seed=2)
    rng = random.Random(3)
    prompts = [
        [rng.randrange(len(SPECIALS), shape.vocab) for _ in range(rng.randrange(3, 24))] * rng.choice((1, 2))
        for _ in range(p.greedy_prompts)
    ]
    params = SamplingParams(max_tokens=p.greedy_tokens, ignore_eos=True)
    max_len = max(len(x) for x in prompts) + p.greedy_tokens + 1
    plain = engine_decode(Engine(target, None, engine_config(3, 4, 1, max_len)), prompts, params, False)
    section.row("plain, batch 1 (the reference)", "ok", tokens=plain.tokens)
    hf = hf_decode(target, prompts[:1], p.greedy_tokens, together=False)
    section.row(
        "transformers generate, fp32", "info", identical_to_plain=identical(hf.outputs, plain.outputs[:1])
    )
    cases = {  # name: (drafter, num_candidates, depth, adaptive)
        "tree k=3 depth=4": (lambda: ModelDrafter(draft), 3, 4, False),
        "chain depth=4": (lambda: ModelDrafter(draft), 1, 4, False),
        "draft = target, tree": (lambda: ModelDrafter(target), 3, 4, False),
        "n-gram": (NgramDrafter, 3, 4, False),
        "adaptive tree (the policy, its probes and observations)": (lambda: ModelDrafter(draft), 3, 4, True),
    }
    for name, (drafter, k, depth, adaptive) in cases.items():
        for together in (False, True):
            budget.check(f"greedy {name}")
            config = replace(engine_config(k, depth, len(prompts), max_len), adaptive=adaptive)
            engine = Engine(target, drafter(), config)
            out = engine_decode(engine, prompts, params, together)
            same = identical(out.outputs, plain.outputs)
            section.row(
                f"greedy {name}, {'batched' if together else 'batch 1'}",
                "pass" if same == f"{len(prompts)}/{len(prompts)}" else "FAIL",
                identical_to_plain=same,
                mean_accepted_length=out.mean_accepted_length,
            )
    if p.dtype != torch.float32:
        budget.check("greedy in the benchmark dtype")
        low = random_llama(shape, p.device, p.dtype, seed=1, sharpen=8.0)
        ref = engine_decode(Engine(low, None, engine_config(3, 4, 1, max_len)), prompts, params, False)
        tree = engine_decode(
            Engine(low, ModelDrafter(low), engine_config(3, 4, len(prompts), max_len)), prompts, params, True
        )
        section.row(
            f"greedy tree (draft = target), batched, {str(p.dtype).removeprefix('torch.')}",
            "info",
            identical_to_plain=identical(tree.outputs, ref.outputs),
            mean_accepted_length=tree.mean_accepted_length,
            note="rounding differs with the batch's shape in low precision",
        )


# -- (a) sampling exactness -------------------------------------------------------------------
def chi_square_pvalue(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of ``samples`` to ``dist``. Outcomes expected fewer than 5 times are pooled
    by their first token, and pools still that small into one more, so a few hundred samples
    still test the first token's distribution. The p-value is the chi-square survival function
    ``Q(df / 2, stat / 2)`` (torch's gammaincc); NaN with fewer than two bins."""
    counts = Counter(samples)
    if not set(counts) <= set(dist):
        return 0.0
    n = len(samples)
    bins: dict[object, list[float]] = {}
    for outcome, prob in dist.items():
        key = outcome if prob * n >= 5 else ("pool", outcome[0])
        observed, expected = bins.setdefault(key, [0.0, 0.0])
        bins[key] = [observed + counts[outcome], expected + prob * n]
    rest = [0.0, 0.0]
    for key in [k for k, (_, e) in bins.items() if e < 5]:
        observed, expected = bins.pop(key)
        rest = [rest[0] + observed, rest[1] + expected]
    cells = list(bins.values()) + ([rest] if rest[1] > 0 else [])
    if len(cells) < 2:
        return float("nan")
    stat = sum((o - e) ** 2 / e for o, e in cells)
    half_df = torch.tensor((len(cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_df, torch.tensor(stat / 2, dtype=torch.float64)))


def exact_distribution(
    model: torch.nn.Module, prompt: list[int], length: int, processing: Processing
) -> dict[tuple[int, ...], float]:
    """P(x1..xL | prompt) of a float64 copy of ``model``, every continuation enumerated."""
    vocab = model.config.vocab_size
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1]
        probs = processed_probs(logits, [processing] * len(logits))
        dist = {
            (*x, t): dist[x] * probs[i, t].item()
            for i, x in enumerate(prefixes)
            for t in range(vocab)
            if probs[i, t] > 0
        }
    return dist


def sample_through(
    engine: Engine, prompt: list[int], processing: Processing, count: int, length: int, seeded: bool
) -> list[tuple[int, ...]]:
    """``count`` samples of ``prompt``, decoded together: each with its own seed, or unseeded
    (the device's own generator)."""
    params = [
        SamplingParams(
            max_tokens=length,
            ignore_eos=True,
            seed=17 + i if seeded else None,
            temperature=processing.temperature,
            top_p=processing.top_p,
            top_k=processing.top_k,
        )
        for i in range(count)
    ]
    seqs = [engine.add_request(f"s{i}", prompt, q) for i, q in enumerate(params)]
    with no_math_attention(engine.target.device):
        while engine.has_unfinished():
            engine.step()
    return [tuple(s.output_ids) for s in seqs]


def sampling_exactness(p: Profile, section: Section, budget: Budget) -> None:
    """Sampled speculation on the device, seeded and unseeded, against the exact distribution
    of an 8-token vocabulary model (every 3-token continuation enumerated on the CPU in float64)."""
    length, prompt = 3, [5, 6, 7, 4]
    host = random_llama(SAMPLING_MODEL, "cpu", torch.float64, seed=5, sharpen=2.0)
    draft_host = noisy_copy(host, noise=1.0, seed=6)
    target = replace(
        host, model=copy_to(host.model, p.device), device=torch.device(p.device), dtype=torch.float32
    )
    draft = replace(
        draft_host, model=copy_to(draft_host.model, p.device), device=target.device, dtype=torch.float32
    )
    config = EngineConfig(3, 3, 16, max_batch=256, max_model_len=16, adaptive=False)
    for shape, k, depth, setting, seeded in p.sampling_cases:
        budget.check(f"sampling {shape} {setting}")
        processing = SAMPLING_SETTINGS[setting]
        engine = Engine(target, drafting(draft), replace(config, num_candidates=k, depth=depth))
        samples = sample_through(engine, prompt, processing, p.samples, length, seeded)
        pvalue = chi_square_pvalue(samples, exact_distribution(host.model, prompt, length, processing))
        section.row(
            f"sampled {shape} k={k} depth={depth}, {setting}, {'seeded' if seeded else 'unseeded'}: "
            "target's distribution",
            "pass" if pvalue >= ALPHA else "FAIL",
            p_value=round(pvalue, 4),
            samples=p.samples,
        )
    budget.check("the power check")
    plain_draft = Engine(draft, None, config)
    samples = sample_through(plain_draft, prompt, SAMPLING_SETTINGS["t1"], p.samples, length, seeded=False)
    pvalue = chi_square_pvalue(
        samples, exact_distribution(host.model, prompt, length, SAMPLING_SETTINGS["t1"])
    )
    section.row(
        "the draft's own samples against the target's distribution (must be rejected)",
        "pass" if pvalue < ALPHA else "FAIL",
        p_value=pvalue,
        samples=p.samples,
    )


def copy_to(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A float32 copy of a float64 host model on ``device``."""
    with torch.device(device):
        copy = LlamaForCausalLM._from_config(model.config, dtype=torch.float32)
    copy.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    copy.requires_grad_(False).eval()
    return copy


# -- (b) speed --------------------------------------------------------------------------------
def speed(p: Profile, shape: Shape, section: Section, budget: Budget, models: dict[str, LoadedModel]) -> None:
    """Plain, chain and tree against transformers, batch 1 and batched, for two drafts."""
    target = models.get(shape.name) or random_llama(shape, p.device, p.dtype, seed=11)
    models[shape.name] = target
    drafts = {
        "draft = target": target,
        f"draft {p.draft.name}": random_llama(p.draft, p.device, p.dtype, seed=12),
    }
    batch1 = random_prompts(p.prompts, p.prompt_len, shape.vocab, seed=21)
    batched = random_prompts(p.batch, p.prompt_len, shape.vocab, seed=22)
    params = SamplingParams(max_tokens=p.new_tokens, ignore_eos=True)
    max_len = p.prompt_len + p.new_tokens + 1
    engines: dict[str, Callable[[], Engine]] = {
        "plain": lambda: Engine(target, None, engine_config(3, 4, p.batch, max_len))
    }
    for label, draft in drafts.items():
        engines[f"chain, {label}"] = lambda d=draft: Engine(
            target, drafting(d), engine_config(1, 4, p.batch, max_len)
        )
        engines[f"tree, {label}"] = lambda d=draft: Engine(
            target, drafting(d), engine_config(3, 4, p.batch, max_len)
        )
    warm = random_prompts(1, 8, shape.vocab, seed=23)
    for together, prompts in ((False, batch1), (True, batched)):
        mode = f"batch {len(prompts)}" if together else "batch 1"
        budget.check(f"{shape.name} {mode}")
        hf_decode(target, warm, 2, together=False)
        generate = hf_decode(target, prompts, p.new_tokens, together)
        section.row(
            f"{shape.name} {mode}: transformers generate",
            "ok",
            tokens_per_second=round(generate.tokens_per_second, 1),
        )
        assisted: dict[str, Decoded] = {}
        if not together:  # transformers' assisted generation takes one sequence at a time
            for label, draft in drafts.items():
                budget.check(f"{shape.name} assisted, {label}")
                hf_decode(target, warm, 2, together=False, assistant=draft)
                assisted[label] = hf_decode(target, prompts, p.new_tokens, together, assistant=draft)
                section.row(
                    f"{shape.name} {mode}: transformers assisted, {label}",
                    "ok",
                    tokens_per_second=round(assisted[label].tokens_per_second, 1),
                    vs_generate=round(assisted[label].tokens_per_second / generate.tokens_per_second, 3),
                )
        plain_out = None
        for name, make in engines.items():
            budget.check(f"{shape.name} {mode} {name}")
            engine = make()
            engine_decode(engine, warm, SamplingParams(max_tokens=2, ignore_eos=True), together=False)
            out = engine_decode(engine, prompts, params, together)
            sync(p.device)
            if plain_out is None:
                plain_out = out
            label = name.partition(", ")[2]
            row = section.row(
                f"{shape.name} {mode}: multiguess {name}",
                "ok",
                tokens_per_second=round(out.tokens_per_second, 1),
                vs_generate=round(out.tokens_per_second / generate.tokens_per_second, 3),
                vs_plain=round(out.tokens_per_second / plain_out.tokens_per_second, 3),
                identical_to_generate=identical(out.outputs, generate.outputs),
                identical_to_plain=identical(out.outputs, plain_out.outputs),
                mean_accepted_length=out.mean_accepted_length,
            )
            if label in assisted:
                row["vs_assisted"] = round(out.tokens_per_second / assisted[label].tokens_per_second, 3)
            del engine
            free_device()
    del drafts
    free_device()


def embedded_pair(p: Profile, section: Section, budget: Budget) -> None:
    """The embedded default pair, where its package is installed, through the same comparison."""
    try:
        from multiguess.llm import load_pair

        # Float weights on any device (the Q4_1 file is the CPUs' default), a float draft.
        target, draft = load_pair(None, None, "auto", p.device, None, "none", quantization="none")
    except (ImportError, FileNotFoundError) as exc:
        section.status, section.note = "skipped", f"embedded pair not present: {exc}"
        return
    prompts = random_prompts(p.prompts, 32, target.model.config.vocab_size, seed=31)
    params = SamplingParams(max_tokens=p.new_tokens, ignore_eos=True)
    max_len = 32 + p.new_tokens + 1
    target.model.generation_config.eos_token_id = None
    generate = hf_decode(target, prompts, p.new_tokens, together=False)
    assisted = hf_decode(target, prompts, p.new_tokens, together=False, assistant=draft) if draft else None
    section.row(
        "embedded: transformers generate", "ok", tokens_per_second=round(generate.tokens_per_second, 1)
    )
    if assisted is not None:
        section.row(
            "embedded: transformers assisted",
            "ok",
            tokens_per_second=round(assisted.tokens_per_second, 1),
            vs_generate=round(assisted.tokens_per_second / generate.tokens_per_second, 3),
        )
    plain = None
    for name, (d, k) in {"plain": (None, 3), "chain": (draft, 1), "tree": (draft, 3)}.items():
        budget.check(f"embedded {name}")
        out = engine_decode(
            Engine(target, drafting(d), engine_config(k, 4, 1, max_len)), prompts, params, together=False
        )
        plain = plain or out
        row = section.row(
            f"embedded: multiguess {name}",
            "ok",
            tokens_per_second=round(out.tokens_per_second, 1),
            vs_generate=round(out.tokens_per_second / generate.tokens_per_second, 3),
            vs_plain=round(out.tokens_per_second / plain.tokens_per_second, 3),
            identical_to_generate=identical(out.outputs, generate.outputs),
            identical_to_plain=identical(out.outputs, plain.outputs),
            mean_accepted_length=out.mean_accepted_length,
        )
        if assisted is not None:
            row["vs_assisted"] = round(out.tokens_per_second / assisted.tokens_per_second, 3)


# -- (c) CUDA graphs --------------------------------------------------------------------------
def graphs_against_eager(
    p: Profile, shape: Shape, section: Section, budget: Budget, models: dict[str, LoadedModel]
) -> None:
    """The same engine with and without CUDA graphs (both on the torch backend). Identity is
    judged in float32 with TF32 off (greedy, and seeded sampling, token for token): eager
    decode of equal lengths attends unmasked while the graph body always masks and pads, so in
    bf16 rounding alone may flip a near-tie. Speed is measured in the benchmark dtype, where
    identity is only reported. On CUDA each engine first decodes the same prompts once,
    untimed, so every bucket the timed run meets is captured already."""
    exact_float32()
    batch1 = random_prompts(p.prompts, p.prompt_len, shape.vocab, seed=51)
    batched = random_prompts(p.batch, p.prompt_len, shape.vocab, seed=52)
    greedy = SamplingParams(max_tokens=p.new_tokens, ignore_eos=True)
    seeded = replace(greedy, temperature=1.0, seed=5)
    config = replace(engine_config(3, 4, p.batch, p.prompt_len + p.new_tokens + 1), backend="torch")
    for dtype in dict.fromkeys((torch.float32, p.dtype)):
        judged = dtype == torch.float32
        timed = dtype == p.dtype
        if dtype == p.dtype:
            target = models.get(shape.name) or random_llama(shape, p.device, dtype, seed=11)
            models[shape.name] = target
        else:
            target = random_llama(shape, p.device, dtype, seed=11)
        draft = random_llama(p.draft, p.device, dtype, seed=12)
        cases = [(False, batch1, "plain", None, greedy), (False, batch1, "tree", draft, greedy)]
        cases += [(True, batched, "plain", None, greedy), (True, batched, "tree", draft, greedy)]
        if judged:
            cases.append((True, batched, "tree, sampled (seeded)", draft, seeded))
        for together, prompts, name, d, params in cases:
            mode = f"batch {len(prompts)}" if together else "batch 1"
            label = f"{shape.name} {mode}: {name}{'' if d is None else f', draft {p.draft.name}'}, graphs"
            label += f", {str(dtype).removeprefix('torch.')}"
            budget.check(label)
            runs = {}
            for graphs in (False, True):
                engine = Engine(target, drafting(d), replace(config, cuda_graphs=graphs))
                if timed and p.device.startswith("cuda"):  # the CPU captures nothing: no warm-up
                    engine_decode(engine, prompts, params, together)
                runs[graphs] = engine_decode(engine, prompts, params, together)
                del engine
                free_device()
            same = identical(runs[True].outputs, runs[False].outputs)
            row = section.row(
                label,
                ("pass" if same == f"{len(prompts)}/{len(prompts)}" else "FAIL") if judged else "info",
                identical_to_eager=same,
                mean_accepted_length=runs[True].mean_accepted_length,
            )
            if timed:
                row["tokens_per_second"] = round(runs[True].tokens_per_second, 1)
                row["vs_eager"] = round(runs[True].tokens_per_second / runs[False].tokens_per_second, 3)
                row["note"] = f"eager {runs[False].tokens_per_second:.1f} tok/s"
        del target, draft
        free_device()


# -- (d) memory plan --------------------------------------------------------------------------
def memory_plan(p: Profile, section: Section, budget: Budget, models: dict[str, LoadedModel]) -> None:
    """An engine left to fill the device (max_model_len from the config, up to 256 sequences):
    its plan, and what it then allocates against the budget; settings that cannot fit must
    fail before any request."""
    shape = p.plan_model
    target = models.get(shape.name) or random_llama(shape, p.device, p.dtype, seed=11)
    models[shape.name] = target
    draft = random_llama(p.draft, p.device, p.dtype, seed=12)
    sequences = 256 if p.device.startswith("cuda") else p.batch
    config = EngineConfig(3, 4, 16, max_batch=sequences, adaptive=False, gpu_memory_utilization=0.9)
    try:
        Engine(target, None, replace(config, max_model_len=shape.max_positions + 1))
        section.row("max_model_len above the config's limit", "FAIL", note="no error")
    except EngineConfigError as exc:
        section.row("max_model_len above the config's limit", "pass", note=str(exc)[:120])
    engine = Engine(target, drafting(draft), config)
    plan = engine.memory_plan
    if plan is None:
        section.row(
            f"{p.device}: not planned",
            "info",
            note=f"caches {engine.config.max_batch} × {engine.config.max_model_len} tokens (the config's limit, capped)",
        )
        return
    for model, line in zip(plan.models, plan.lines(), strict=True):
        section.row(f"plan: {model.name}", "info", note=line.removeprefix("memory plan: "))
    device = target.device
    torch.cuda.reset_peak_memory_stats(device)
    running = min(plan.sequences, 32)
    prompts = random_prompts(running, 16, shape.vocab, seed=41)
    engine_decode(engine, prompts, SamplingParams(max_tokens=4, ignore_eos=True), together=True)
    total = torch.cuda.mem_get_info(device)[1]
    peak = torch.cuda.max_memory_reserved(device) + plan.devices[0].elsewhere
    allowed = total * plan.utilization
    section.row(
        f"{plan.sequences} sequences × {plan.capacity} tokens; peak while {running} decode",
        "pass" if peak <= allowed else "FAIL",
        note=f"peak {peak / 2**30:.2f} GiB of {allowed / 2**30:.2f} GiB allowed ({total / 2**30:.2f} GiB total)",
    )
    del engine
    free_device()
    budget.check("the oversized setting")
    try:
        Engine(target, drafting(draft), replace(config, gpu_memory_utilization=0.05))
        section.row("utilization 0.05 (cannot fit)", "FAIL", note="no error")
    except InsufficientMemoryError as exc:
        section.row("utilization 0.05 (cannot fit)", "pass", note=str(exc)[:160])


# -- (e) long context -------------------------------------------------------------------------
def long_context(p: Profile, section: Section, budget: Budget, models: dict[str, LoadedModel]) -> None:
    """``sequences`` prompts of ragged lengths up to ``max_model_len``, each prefilled whole,
    decoding trees together: the memory plan must hold them all and the peak while they run
    stay inside it, and every attention call at that length (ragged batches, trees, grouped
    heads) goes through the fused paths. In float32 (the dry run) the tokens must equal plain
    decoding."""
    lc = p.long_context
    target = models.get(lc.target.name) or random_llama(lc.target, p.device, p.dtype, seed=11)
    models[lc.target.name] = target
    draft = random_llama(lc.draft, p.device, p.dtype, seed=12)
    config = EngineConfig(
        3,
        4,
        16,
        max_batch=lc.sequences,
        max_model_len=lc.max_model_len,
        adaptive=False,
        gpu_memory_utilization=0.9,
    )
    engine = Engine(target, drafting(draft), config)
    plan = engine.memory_plan
    if plan is not None:
        section.row(
            f"plan at max_model_len {lc.max_model_len}: {plan.sequences} sequences",
            "pass" if plan.sequences >= lc.sequences else "FAIL",
            note=" ".join(line.removeprefix("memory plan: ") for line in plan.lines())[:300],
        )
    longest = lc.max_model_len - lc.new_tokens - 1
    rng = random.Random(61)
    lengths = [longest - i * longest // (2 * lc.sequences) for i in range(lc.sequences)]  # ragged
    prompts = [[rng.randrange(len(SPECIALS), lc.target.vocab) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=lc.new_tokens, ignore_eos=True)
    if p.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(target.device)
    budget.check("the long-context decode")
    tree = engine_decode(engine, prompts, params, together=True)
    sync(p.device)
    row = section.row(
        f"{lc.target.name}: {lc.sequences} sequences, prompts of {lengths[-1]}..{longest} tokens, "
        "tree k=3 depth=4",
        "ok",
        tokens_per_second=round(tree.tokens_per_second, 1),
        mean_accepted_length=tree.mean_accepted_length,
    )
    if plan is not None:
        total = torch.cuda.mem_get_info(target.device)[1]
        peak = torch.cuda.max_memory_reserved(target.device) + plan.devices[0].elsewhere
        row["status"] = "pass" if peak <= total * plan.utilization else "FAIL"
        row["note"] = f"peak {peak / 2**30:.2f} GiB of {total * plan.utilization / 2**30:.2f} GiB allowed"
    del engine
    free_device()
    if p.dtype == torch.float32:
        budget.check("plain decoding at long context")
        plain = engine_decode(Engine(target, None, replace(config, depth=1)), prompts, params, together=True)
        same = identical(tree.outputs, plain.outputs)
        section.row(
            "the same prompts, plain decoding",
            "pass" if same == f"{len(prompts)}/{len(prompts)}" else "FAIL",
            identical_to_plain=same,
        )


# -- (f) versions and the device boundary -------------------------------------------------------
def has_triton() -> bool:
    from torch.utils._triton import has_triton as available

    return available()


def toolchain_problems(device: str, triton: bool, compiler: str | None) -> list[str]:
    """What compiling FlexAttention's CUDA kernels needs and ``device`` lacks: Triton, and a C
    compiler (Triton builds its launcher with one on first use)."""
    if not device.startswith("cuda"):
        return []
    problems = [] if triton else ["Triton is not installed; FlexAttention's CUDA kernels are compiled by it"]
    if compiler is None:
        problems.append("no C compiler (cc or gcc) on PATH; Triton builds its kernel launcher with one")
    return problems


def cpu_modules(loaded: list[str]) -> list[str]:
    """The CPU family's modules among ``loaded`` (its C kernels build on first use)."""
    return sorted(m for m in loaded if m.startswith("multiguess.engine.backends.cpu"))


def environment_checks(p: Profile, section: Section) -> None:
    """The versions the code relies on; on CUDA, ``--dtype auto``'s choice and that nothing in
    the check's path reached the CPU family (whose first use compiles C kernels)."""
    problems = version_problems(INSTALLED)
    section.row(
        "versions: "
        + ", ".join(f"{name} {INSTALLED[name]} (>= {least})" for name, (least, _) in REQUIRED.items()),
        "FAIL" if problems else "pass",
        note="; ".join(problems),
    )
    loaded = cpu_modules(list(sys.modules))
    if not p.device.startswith("cuda"):
        section.row("CPU family modules loaded", "info", note=", ".join(loaded) or "none")
        return
    native = torch.bfloat16 if torch.cuda.get_device_capability(p.device) >= (8, 0) else torch.float16
    got = resolve_dtype("auto", p.device)
    section.row("--dtype auto on this GPU", "pass" if got == native else "FAIL", note=str(got))
    section.row("no CPU kernels on a CUDA host", "FAIL" if loaded else "pass", note=", ".join(loaded))


# -- the run ----------------------------------------------------------------------------------
def environment(p: Profile, commit: str) -> dict:
    info = {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": p.device,
        "dtype": str(p.dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if p.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(p.device)
        info |= {
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        }
    return info


def run_section(
    sections: list[Section],
    name: str,
    budget: Budget,
    work: Callable[[Section], None],
    budgeted: bool = True,
) -> None:
    """Run one section, recording its failure or the budget running out (unless ``budgeted`` is
    off: a quick section that always runs)."""
    section = Section(name)
    sections.append(section)
    start = time.perf_counter()
    try:
        if budgeted:
            budget.check(name)
        work(section)
    except OutOfTime as exc:
        section.status, section.note = ("partial" if section.rows else "skipped"), str(exc)
    except Exception as exc:  # a failing section is recorded; the others still run
        section.status = "failed"
        section.note = f"{type(exc).__name__}: {exc}"
        section.rows.append({"case": "error", "status": "FAIL", "traceback": traceback.format_exc(limit=6)})
    finally:
        section.seconds = round(time.perf_counter() - start, 1)
        free_device()
        print(
            f"[gpu-check] {name}: {section.status} in {section.seconds} s {section.note}",
            file=sys.stderr,
            flush=True,
        )


COLUMNS = (
    ("tok/s", "tokens_per_second"),
    ("× generate", "vs_generate"),
    ("× assisted", "vs_assisted"),
    ("× plain", "vs_plain"),
    ("× eager", "vs_eager"),
    ("identical to generate", "identical_to_generate"),
    ("identical to plain", "identical_to_plain"),
    ("identical to eager", "identical_to_eager"),
    ("accepted length", "mean_accepted_length"),
    ("p", "p_value"),
)


def table(sections: list[Section]) -> str:
    head = ["section", "case", "status", *(title for title, _ in COLUMNS), "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for section in sections:
        rows = section.rows or [{"case": "", "status": section.status}]
        for row in rows:
            note = row.get("note", "") or (section.note if row is rows[-1] else "")
            cells = [section.name, row["case"], row["status"] or section.status]
            cells += ["" if row.get(key) is None else str(row[key]) for _, key in COLUMNS]
            cells.append(str(note).replace("|", "/").replace("\n", " "))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failed(sections: list[Section]) -> bool:
    return any(s.status == "failed" or any(r["status"] == "FAIL" for r in s.rows) for s in sections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default=os.environ.get("DEVICE") or "cuda", help="cuda (the check) or cpu (dry run)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / ".cache" / "gpu-check", help="folder when $OUT is unset"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds after which no section starts (360 on a GPU)"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; `make gpu-check DEVICE=cpu` is the dry run", file=sys.stderr)
        return 2
    missing = toolchain_problems(args.device, has_triton(), shutil.which("cc") or shutil.which("gcc"))
    if missing:
        print("gpu-check: " + "; ".join(missing), file=sys.stderr)
        return 2
    p = profile(args.device, args.budget)
    if p.device == "cpu":  # tiny shapes: one thread, no waiting on siblings of a shared machine
        torch.set_num_threads(1)
    budget = Budget(p.budget_s)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else args.out
    models: dict[str, LoadedModel] = {}
    sections: list[Section] = []
    run_section(sections, "(0) fused attention", budget, lambda s: fused_attention(p, s, budget))
    run_section(sections, "(a) lossless greedy", budget, lambda s: lossless_greedy(p, s, budget))
    run_section(sections, "(a) sampling exactness", budget, lambda s: sampling_exactness(p, s, budget))
    first, *rest = p.targets
    run_section(
        sections, "(c) CUDA graphs", budget, lambda s: graphs_against_eager(p, first, s, budget, models)
    )
    run_section(sections, "(e) long context", budget, lambda s: long_context(p, s, budget, models))
    run_section(sections, "(d) memory plan", budget, lambda s: memory_plan(p, s, budget, models))
    run_section(sections, f"(b) speed {first.name}", budget, lambda s: speed(p, first, s, budget, models))
    models.pop(first.name, None)
    for shape in rest:
        run_section(
            sections,
            f"(b) speed {shape.name}",
            budget,
            lambda s, shape=shape: speed(p, shape, s, budget, models),
        )
    models.clear()
    if p.embedded:
        run_section(sections, "(b) embedded pair", budget, lambda s: embedded_pair(p, s, budget))
    run_section(
        sections,
        "(f) versions and device boundary",
        budget,
        lambda s: environment_checks(p, s),
        budgeted=False,
    )
    imported = sorted({m.split(".")[0] for m in sys.modules} & set(SERVING_ONLY))
    report = {
        "environment": environment(p, os.environ.get("GPU_CHECK_COMMIT") or git_commit()),
        "budget_s": p.budget_s,
        "seconds": round(p.budget_s - budget.left(), 1),
        "serving_only_modules_imported": imported,
        "passed": not failed(sections) and not imported,
        "sections": [s.__dict__ for s in sections],
    }
    rendered = table(sections)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(rendered + "\n")
    print(json.dumps(report["environment"]))
    print(rendered)
    print(
        f"gpu-check: {'passed' if report['passed'] else 'FAILED'} in {report['seconds']} s; {out / 'gpu_check.json'}"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
