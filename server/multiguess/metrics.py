"""Prometheus metrics of one server, in its own registry (several servers can share a process).

The names are a contract (DESIGN.md): the operator's autoscaler scrapes the queue histogram.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from multiguess.engine.guard import FALLBACK_REASONS
from multiguess.engine.sequence import SpecStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
REJECT_REASONS = ("queue_full", "not_ready")
SPEC_FIELDS = ("verify_steps", "draft_tokens", "accepted_tokens")
# Drafted and accepted tokens by source: the drafter's own nodes (model, EAGLE-3 or n-gram) and
# the copy drafts grafted onto its trees (or drafting alone: --drafter suffix) and the drafts
# that follow a request's prediction, as SpecStats
# counts them (name of the drafted count, name of the accepted count).
SOURCE_FIELDS = {
    "copy": ("copy_draft_tokens", "copy_accepted_tokens"),
    "prediction": ("prediction_draft_tokens", "prediction_accepted_tokens"),
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        reg = self.registry
        self.queue = Histogram(
            "multiguess_request_queue_seconds",
            "Time from admission until the engine starts the request.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            "multiguess_time_to_first_token_seconds",
            "Time from admission to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "multiguess_inter_token_latency_seconds",
            "Time per generated token after the first (a step's gap shared by its tokens).",
            buckets=TOKEN_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "multiguess_e2e_request_seconds",
            "Time from admission to the last token of finished requests.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.running = Gauge("multiguess_requests_running", "Samples in the engine's batch.", registry=reg)
        self.waiting = Gauge(
            "multiguess_requests_waiting", "Samples admitted but not yet in the batch.", registry=reg
        )
        self.prompt_tokens = Counter("multiguess_prompt_tokens", "Prompt tokens admitted.", registry=reg)
        self.prefill_chunk = Gauge(
            "multiguess_prefill_chunk_tokens",
            "Prompt tokens prefilled per engine step at most (chunked prefill); 0: whole prompts.",
            registry=reg,
        )
        self.generation_tokens = Counter("multiguess_generation_tokens", "Tokens generated.", registry=reg)
        self.prefix_queried = Counter(
            "multiguess_prefix_cache_queried_tokens",
            "Prompt tokens of samples that started with prefix caching on.",
            registry=reg,
        )
        self.prefix_hits = Counter(
            "multiguess_prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
            registry=reg,
        )
        self.spec = {
            name: Counter(f"multiguess_spec_{name}", help_text, registry=reg)
            for name, help_text in (
                ("verify_steps", "Target verification forwards."),
                ("draft_tokens", "Drafted tokens the target verified."),
                ("accepted_tokens", "Drafted tokens the target accepted."),
            )
        }
        self.source_tokens = {
            kind: Counter(
                f"multiguess_spec_source_{kind}_tokens",
                f"{what} by drafting source: draft (the drafter's own nodes: model, EAGLE-3 or n-gram), "
                "copy (copy drafts from the request's text and recent outputs), prediction (the "
                "request's predicted output).",
                ["source"],
                registry=reg,
            )
            for kind, what in (
                ("draft", "Drafted tokens the target verified"),
                ("accepted", "Drafted tokens accepted"),
            )
        }
        for counter in self.source_tokens.values():
            for source in ("draft", *SOURCE_FIELDS):
                counter.labels(source=source)
        self.fallback_steps = Counter(
            "multiguess_spec_fallback_steps",
            "Sample-steps decoded without the drafter, by reason: timeout, refused (by a draft "
            "server), invalid (a draft failed validation), paused (cool-down after a failure), error.",
            ["reason"],
            registry=reg,
        )
        for reason in FALLBACK_REASONS:
            self.fallback_steps.labels(reason=reason)
        self.batch_size = Histogram(
            "multiguess_batch_size",
            "Sequences verified together in one engine step.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=reg,
        )
        self.tree_nodes = Histogram(
            "multiguess_spec_tree_nodes",
            "Drafted nodes per sequence per step: the effective tree size after adaptation (0: none).",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64),
            registry=reg,
        )
        # Where guesses land: per tree depth, the levels verified and accepted; per accepted
        # child, its rank among its siblings (0: the draft's first guess; wider trees catch more).
        self.level_verified = Counter(
            "multiguess_spec_level_verified",
            "Tree levels the target verified, by depth below the root (1: the first drafted token).",
            ["depth"],
            registry=reg,
        )
        self.level_accepted = Counter(
            "multiguess_spec_level_accepted",
            "Tree levels at which the target accepted a drafted child, by depth below the root.",
            ["depth"],
            registry=reg,
        )
        self.accepted_rank = Counter(
            "multiguess_spec_accepted_rank",
            "Accepted drafted children by their rank among their siblings (the tree's width).",
            ["rank"],
            registry=reg,
        )
        self.rejected = Counter(
            "multiguess_requests_rejected",
            "Requests refused before generation, by reason.",
            ["reason"],
            registry=reg,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)  # present (at 0) before the first rejection

    def add_spec(self, before: SpecStats, after: SpecStats, fallbacks: Mapping[str, int]) -> None:
        """Move the speculation counters by what the engine's totals moved since ``before``, and
        the fallback counter by ``fallbacks`` (steps by reason)."""
        for name in SPEC_FIELDS:
            delta = getattr(after, name) - getattr(before, name)
            if delta > 0:
                self.spec[name].inc(delta)
        for kind, total, index in (("draft", "draft_tokens", 0), ("accepted", "accepted_tokens", 1)):
            own = getattr(after, total) - getattr(before, total)
            for source, fields in SOURCE_FIELDS.items():
                delta = getattr(after, fields[index]) - getattr(before, fields[index])
                own -= delta
                if delta > 0:
                    self.source_tokens[kind].labels(source=source).inc(delta)
            if own > 0:
                self.source_tokens[kind].labels(source="draft").inc(own)
        for reason, steps in fallbacks.items():
            if steps > 0:
                self.fallback_steps.labels(reason=reason).inc(steps)

    def observe_step(self, tree_sizes: list[int], outcomes: list[list[tuple[int, int | None]]]) -> None:
        """One engine step's batch size, each sequence's tree size, and each sequence's verified
        levels in depth order: (children, the accepted child's rank or None)."""
        if tree_sizes:
            self.batch_size.observe(len(tree_sizes))
        for size in tree_sizes:
            self.tree_nodes.observe(size)
        for levels in outcomes:
            for depth, (_, rank) in enumerate(levels, start=1):
                self.level_verified.labels(depth=str(depth)).inc()
                if rank is not None:
                    self.level_accepted.labels(depth=str(depth)).inc()
                    self.accepted_rank.labels(rank=str(rank)).inc()

    def observe_gap(self, seconds: float, tokens: int) -> None:
        """One step's gap, spread evenly over the tokens it produced."""
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
