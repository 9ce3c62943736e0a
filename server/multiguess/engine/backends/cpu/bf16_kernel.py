"""multiguess's bf16 kernels for CPUs with AVX512-BF16 or AVX2, compiled from C on first use.

Why: a decode step streams every weight once, and for decode-sized products oneDNN streams
them well below the memory's bandwidth on CPUs without AMX; the product here
(``kernels/bf16_kernels.c``: panels of 64 output rows, one contiguous stream each,
``vdpbf16ps``) streams faster, is no slower for many rows, and runs the norms, SiLU gating and
residual adds around it in the same call. Rotary with the cache write, and attention, are one
call each instead of dozens of framework calls, and the runner calls all of a layer's kernels
at once (``run_layer``: one call from Python per layer instead of six). docs/ENGINE.md has the
measurements. Every row of
every kernel is computed independently of the others, so a token's logits are the same bits in
a one-token decode step and inside a verified tree: speculation equals plain decoding in bf16
as well as in fp32. On CPUs with AMX tiles the products run on them when measured no slower
for one row (``matrix_units``): a tree's rows then cost about what one row costs. CPUs with
AVX2 and FMA but no AVX512-BF16 get the same kernels built for them (``isa_avx2.h``: bf16
widened to fp32 in registers), so a decode step streams bf16 weights there too, where oneDNN's
bf16 path is several times slower than fp32.

They are built with the system C compiler into the cache folder (keyed by the sources, the
variant and its flags) the first time a model loads, in about a second, or ahead of time, every
variant, by ``python -m multiguess.engine.backends.cpu.build_kernels`` (the server image does,
so it needs no compiler); without a compiler, on other CPUs, or with ``MULTIGUESS_BF16_KERNEL=0``
the forward uses oneDNN and torch. The same library holds sampling's work over a row of logits
(``kernels/seeded_race.c``: ``seeded_argmax``, ``kept_set``, ``kept_race``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from multiguess.cache_dirs import cache_roots

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
PANEL = 64
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class Variant:
    """One instruction set the library is built for: the CPU flags it needs, its compiler flags."""

    needs: frozenset[str]
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Sources:
    """One library's C sources and headers and the variants it is built in (best first); the
    quantized kernels (``quant_kernel.py``) are another such library, built the same way."""

    name: str
    files: tuple[Path, ...]
    headers: tuple[Path, ...]
    variants: dict[str, Variant]
    switch: str  # the environment variable that, set to 0, keeps the library unused


VARIANTS = {  # best first
    "avx512": Variant(
        frozenset({"avx512_bf16"}),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
    ),
    "avx2": Variant(frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
}
BF16 = Sources(
    "bf16_kernels",
    (KERNELS / "bf16_kernels.c", KERNELS / "seeded_race.c"),  # one library
    (*sorted(KERNELS.glob("isa_*.h")), KERNELS / "layer_step.h"),
    VARIANTS,
    "MULTIGUESS_BF16_KERNEL",
)
PRODUCT = "MULTIGUESS_BF16_PRODUCT"  # auto (measured), amx or avx512


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as the Linux kernel reports them (none elsewhere)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_variant(sources: Sources = BF16) -> str | None:
    """The best variant of the kernels this CPU runs (None: none, the forward uses oneDNN)."""
    return next((name for name, variant in sources.variants.items() if variant.needs <= cpu_flags()), None)


def cpu_has_amx_bf16() -> bool:
    """Whether the CPU has AMX tiles with bf16 products (Sapphire Rapids and later Xeons)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def flags(variant: str, sources: Sources = BF16) -> list[str]:
    return [*COMMON_FLAGS, *sources.variants[variant].flags]


def compiled_path(variant: str, sources: Sources = BF16) -> Path:
    """Where the library of this variant of these sources is: the first cache folder that has
    it (an image bakes it in a read-only one), else where it is built, in the first folder."""
    text = b"".join(path.read_bytes() for path in (*sources.files, *sources.headers))
    digest = hashlib.sha256(text + " ".join(flags(variant, sources)).encode()).hexdigest()[:16]
    places = [root / "kernels" / f"{sources.name}-{variant}-{digest}.so" for root in cache_roots()]
    return next((p for p in places if p.exists()), places[0])


def find_compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(compiler: str, variant: str, sources: Sources = BF16) -> Path:
    """Compile the library unless it is there; any CPU can build any variant (an image build
    host)."""
    target = compiled_path(variant, sources)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *flags(variant, sources), *map(str, sources.files), "-o", str(built), "-lm"]
            subprocess.run(command, check=True, capture_output=True)
            os.replace(built, target)  # atomic: concurrent loaders see a whole file or none
    return target


def open_library(sources: Sources, variant: str | None, no_compiler: str, failed: str) -> ctypes.CDLL | None:
    """The ``variant`` of ``sources`` (the best this CPU runs), built first where it is missing;
    None where there is none, with one log line: ``no_compiler`` says what runs without a
    compiler, ``failed`` prefixes a failed build's or load's error. None, silently, where the
    library's switch is set to 0."""
    if os.environ.get(sources.switch, "1") == "0" or sys.platform != "linux" or variant is None:
        return None
    path = compiled_path(variant, sources)
    try:
        if not path.exists():
            compiler = find_compiler()
            if compiler is None:
                log.info("no C compiler found: %s", no_compiler)
                return None
            path = build(compiler, variant, sources)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or str(error).encode()
        log.warning("%s: %s", failed, detail.decode(errors="replace").strip())
        return None
    log.info("%s (%s) loaded from %s", sources.name, variant, path)
    return lib


class LayerWeights(ctypes.Structure):
    """``multiguess_layer``: one decoder layer's packed weights, norms and cache, built once."""

    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias")],
        *[(name, ctypes.c_void_p) for name in ("gate_up", "gate_up_bias", "down", "down_bias", "cache")],
        ("qkv_n", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class StepPlaces(ctypes.Structure):
    """``multiguess_step``: what the layers of one forward share (shapes, tables, scratch)."""

    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("cos", "sin", "slots", "starts", "mask")],
        *[(name, ctypes.c_void_p) for name in ("qkv", "attn", "gate_up", "h", "queries")],
        *[(name, ctypes.c_int64) for name in ("batch", "width", "d", "heads", "kv_heads", "dim", "capacity")],
        ("length", ctypes.c_int64),
        ("threads", ctypes.c_int),
        ("amx", ctypes.c_int),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (and one log line saying why) when it cannot be used."""
    lib = open_library(
        BF16,
        cpu_variant(),
        "bf16 projections use oneDNN (slower on decode steps)",
        "bf16 kernel unavailable, using oneDNN",
    )
    if lib is None:
        return None
    lib.multiguess_bf16_matmul.argtypes = [
        *[ctypes.c_void_p] * 4,
        *[ctypes.c_int64] * 3,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.multiguess_bf16_matmul.restype = ctypes.c_int
    lib.multiguess_amx_enable.restype = ctypes.c_int
    lib.multiguess_bf16_rope_cache.argtypes = [*[ctypes.c_void_p] * 7, *[ctypes.c_int64] * 6]
    lib.multiguess_bf16_rope_cache.restype = None
    lib.multiguess_attention.argtypes = [
        *[ctypes.c_void_p] * 5,
        *[ctypes.c_int64] * 7,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.multiguess_attention.restype = ctypes.c_int
    lib.multiguess_bf16_layer.argtypes = [
        ctypes.POINTER(LayerWeights),
        ctypes.POINTER(StepPlaces),
        ctypes.c_void_p,
    ]
    lib.multiguess_bf16_layer.restype = ctypes.c_int
    lib.multiguess_seeded_argmax.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_double,
        ctypes.c_uint64,
    ]
    lib.multiguess_seeded_argmax.restype = ctypes.c_int64
    lib.multiguess_kept.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_double,
        ctypes.c_int64,
        ctypes.c_double,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.multiguess_kept.restype = ctypes.c_int64
    lib.multiguess_kept_race.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
    lib.multiguess_kept_race.restype = ctypes.c_int64
    return lib


def loaded() -> ctypes.CDLL:
    """The library, for callers that checked ``usable`` or ``attention_supported`` first."""
    lib = library()
    if lib is None:
        raise RuntimeError("the bf16 kernels are not available: check usable() first")
    return lib


def usable(weight: torch.Tensor) -> bool:
    """bf16 CPU weights with an even input width, on a CPU and build that run the kernel."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 2 == 0
        and library() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` into ``[panels, in/2, 64, 2]``, rows past ``out`` zero."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features // 2, 2).transpose(1, 2).contiguous()


def pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def matmul(
    packed: torch.Tensor,
    out_features: int,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    amx: bool | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for the weight ``packed`` came from; x is bf16 ``[..., in]``.

    ``norm`` (weight, epsilon) multiplies ``RMSNorm(x)`` instead; ``gated`` takes x as
    ``[..., 2 * in]`` (gate, then up) and multiplies ``silu(gate) * up``; ``residual`` (the
    output's shape) is added. Each rounds to bf16 where the module it replaces does. ``amx``
    runs the product on AMX tiles (None: as ``matrix_units`` chose for this process)."""
    lib = loaded()
    if amx is None:
        amx = matrix_units()
    elif amx and not amx_usable():
        raise RuntimeError("AMX tiles are not usable here: check amx_usable() first")
    in_features = packed.shape[1] * 2
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    if residual is not None:
        residual = residual.reshape(y.shape).contiguous()
    status = lib.multiguess_bf16_matmul(
        packed.data_ptr(),
        rows.data_ptr(),
        pointer(bias),
        y.data_ptr(),
        rows.shape[0],
        in_features,
        out_features,
        torch.get_num_threads(),
        pointer(None if norm is None else norm[0]),
        0.0 if norm is None else norm[1],
        int(gated),
        pointer(residual),
        int(amx),
    )
    if status != 0:
        raise MemoryError("bf16 kernel: no memory for the prepared inputs")
    return y.view(*x.shape[:-1], out_features)


def rope_into_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotary on bf16 ``qkv`` ``[B, T, heads + 2 * kv_heads, D]`` (tables ``[B, T, D]``); keys and
    values go to ``layer_cache`` ``[slots, 2 * kv_heads, capacity, D]`` (bf16) at ``starts[b] + t``
    of slot ``slots[b]``; the fp32 queries ``[B, T, heads, D]`` are returned. Bitwise the
    runner's ``apply_rotary`` and cache write, in one call instead of a dozen."""
    lib = loaded()
    batch, width, _, dim = qkv.shape
    kv_heads = layer_cache.shape[1] // 2
    assert qkv.is_contiguous() and layer_cache.is_contiguous() and layer_cache.dtype == torch.bfloat16
    queries = torch.empty(batch, width, heads, dim, dtype=torch.float32)
    lib.multiguess_bf16_rope_cache(
        qkv.data_ptr(),
        cos.contiguous().data_ptr(),
        signed_sin.contiguous().data_ptr(),
        queries.data_ptr(),
        layer_cache.data_ptr(),
        slots.data_ptr(),
        starts.data_ptr(),
        batch,
        width,
        heads,
        kv_heads,
        dim,
        layer_cache.shape[2],
    )
    return queries


@functools.cache
def amx_usable() -> bool:
    """AMX tiles on this CPU, the kernels built, and Linux letting this process use the tiles."""
    lib = library()
    return cpu_has_amx_bf16() and lib is not None and lib.multiguess_amx_enable() == 0


@functools.cache
def matrix_units() -> bool:
    """Whether this process's products run on AMX tiles, chosen once for every runner, so that
    a one-token step and a verified tree always use the same arithmetic: ``$MULTIGUESS_BF16_PRODUCT``
    ``amx`` or ``avx512`` forces a side; ``auto`` (the default) takes AMX where it is usable and
    measured within 10% of AVX512-BF16 for one row (a decode step) and faster for 16 (a tree)."""
    setting = os.environ.get(PRODUCT, "auto")
    if setting not in ("auto", "amx", "avx512"):
        raise ValueError(f"{PRODUCT} must be auto, amx or avx512; got {setting!r}")
    if setting == "avx512" or not amx_usable():
        if setting == "amx":
            log.warning("%s=amx, but AMX tiles are not usable here: products use AVX512-BF16", PRODUCT)
        return False
    if setting == "amx":
        return True
    seconds = product_seconds((1, 16))
    chosen = seconds[1, True] <= 1.1 * seconds[1, False] and seconds[16, True] < seconds[16, False]
    log.info(
        "bf16 products on %s: 1 row %.3f ms (AVX512-BF16 %.3f), 16 rows %.3f ms (%.3f)",
        "AMX tiles" if chosen else "AVX512-BF16",
        *(1000 * seconds[key] for key in ((1, True), (1, False), (16, True), (16, False))),
    )
    return chosen


def product_seconds(
    rows: tuple[int, ...], size: int = 4096, repeats: int = 9
) -> dict[tuple[int, bool], float]:
    """By (rows, amx): the fastest of ``repeats`` products of that many rows by a ``size`` x
    ``size`` bf16 weight (32 MiB: streamed from memory, as a decode step streams a model), on
    AMX tiles and on AVX512-BF16, taking turns."""
    panels = pack(torch.randn(size, size).to(torch.bfloat16))
    inputs = {count: torch.randn(count, size).to(torch.bfloat16) for count in rows}
    best = {(count, amx): float("inf") for count in rows for amx in (True, False)}
    for _ in range(repeats):
        for count, amx in best:
            start = time.perf_counter()
            matmul(panels, size, inputs[count], None, amx=amx)
            best[count, amx] = min(best[count, amx], time.perf_counter() - start)
    return best


def attention_supported(head_dim: int) -> bool:
    """The attention kernel keeps a head in 16-float registers: up to 256 wide, by 16s."""
    return head_dim % 16 == 0 and head_dim <= 256 and library() is not None


def attention(
    queries: torch.Tensor,
    layer_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    length: int,
) -> torch.Tensor:
    """fp32 queries ``[B, T, H, D]`` over cache rows ``[0, length)`` of each sequence's slot in
    bf16 ``layer_cache`` ``[slots, 2 * kv_heads, capacity, D]``, additive ``mask`` ``[B, T, length]``:
    ``[B, T, H * D]`` in bf16. Each query row is computed alone, keys in cache order, hidden keys
    skipped, so a tree node and the same token decoded alone get the same bits."""
    lib = loaded()
    batch, width, heads, dim = queries.shape
    assert queries.is_contiguous() and mask.shape == (batch, width, length)
    assert layer_cache.is_contiguous() and layer_cache.dtype == torch.bfloat16
    out = torch.empty(batch, width, heads * dim, dtype=torch.bfloat16)
    status = lib.multiguess_attention(
        queries.data_ptr(),
        layer_cache.data_ptr(),
        slots.data_ptr(),
        mask.contiguous().data_ptr(),
        out.data_ptr(),
        batch,
        width,
        heads,
        layer_cache.shape[1] // 2,
        dim,
        layer_cache.shape[2],
        length,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("attention kernel: no memory for the scores")
    return out


def seeded_argmax(logits: torch.Tensor, temperature: float, key: int) -> int | None:
    """The winner of a seeded row's race (``sampling.seeded_choice``) over CPU logits ``[V]``,
    or None where the library is not available."""
    lib = library()
    if lib is None or logits.device.type != "cpu":
        return None
    row = logits.float().contiguous()
    return lib.multiguess_seeded_argmax(row.data_ptr(), row.numel(), temperature, key % 2**64)


def kept_set(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A truncated CPU row's kept tokens in rank order and their probabilities, by
    ``sampling.kept_tokens``'s rule (top_k 0: off), from the tokens within a few tempered
    logits of the best; None when those do not hold the kept set or number over ``capacity``
    (a flat row), or where the library is not available. Sums are taken in order and the row's
    normaliser in fp32 lanes, so probabilities may differ from the framework's in the last bits."""
    lib = library()
    if lib is None or logits.device.type != "cpu":
        return None
    row = logits.float().contiguous()
    ids = torch.empty(capacity, dtype=torch.int64)
    probs = torch.empty(capacity, dtype=torch.float64)
    count = lib.multiguess_kept(
        row.data_ptr(), row.numel(), temperature, top_k, top_p, capacity, ids.data_ptr(), probs.data_ptr()
    )
    if count == -2:
        raise MemoryError("kept-set kernel: no memory for the candidates")
    return None if count < 0 else (ids[:count], probs[:count])


def kept_race(ids: torch.Tensor, probs: torch.Tensor, key: int) -> int | None:
    """The rank of the winner of a kept set's seeded race under ``key`` (``sampling.race_top``),
    or None where the library is not available."""
    lib = library()
    if lib is None or ids.device.type != "cpu":
        return None
    return lib.multiguess_kept_race(ids.data_ptr(), probs.data_ptr(), len(ids), key % 2**64)


def run_layer(layer: LayerWeights, step: StepPlaces, x: torch.Tensor) -> None:
    """One decoder layer on the contiguous bf16 residual stream ``x`` ``[B, T, D]``, in place:
    the same kernels as the per-op calls, in one call (``multiguess_bf16_layer``)."""
    if loaded().multiguess_bf16_layer(ctypes.byref(layer), ctypes.byref(step), x.data_ptr()) != 0:
        raise MemoryError("bf16 layer kernel: no memory for the prepared inputs")
