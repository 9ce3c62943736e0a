"""A request's sample as the engine queues it: checked against what this engine serves (its
context, its tree budget, its vocabulary), with its random streams and its predicted output as
token ids. A request refused here never reaches a step."""

from __future__ import annotations

import random

import numpy as np
from transformers import PreTrainedTokenizerBase

from multiguess.engine.config import EngineConfig
from multiguess.engine.prediction import Alignment
from multiguess.engine.sampling import Generators
from multiguess.engine.sequence import Sequence
from multiguess.errors import InvalidRequestError
from multiguess.params import SamplingParams


def new_sequence(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    group: str | None,
    config: EngineConfig,
    tokenizer: PreTrainedTokenizerBase,
    vocab: int,
) -> Sequence:
    """One sample of a request, checked (``InvalidRequestError`` names what is wrong)."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    limit = config.max_model_len
    if len(prompt_ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context length of {limit} tokens"
        )
    cfg = config
    if (params.num_candidates or 0) > cfg.num_candidates or (params.depth or 0) > cfg.depth:
        raise InvalidRequestError(
            f"num_candidates and depth may be at most the server's ({cfg.num_candidates}, {cfg.depth})"
        )
    check_prompt_ids(prompt_ids, vocab)
    if any(not 0 <= token < vocab for token, _ in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
    if any(not 0 <= token < vocab for token in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})")
    generators = None
    if not params.greedy:
        generators = Generators(params.seed if params.seed is not None else random.getrandbits(63))
    seq = Sequence(request_id, list(prompt_ids), params, generators, group=group or request_id)
    predicted = prediction_ids(params, tokenizer, limit, vocab)
    seq.prediction = None if predicted is None else Alignment(predicted)
    return seq


def check_prompt_ids(prompt_ids: list[int], vocab: int) -> None:
    """Refuse token ids the target has no embedding for (they would index past its tables)."""
    if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")


def prediction_ids(
    params: SamplingParams, tokenizer: PreTrainedTokenizerBase, limit: int, vocab: int
) -> np.ndarray | None:
    """The request's predicted output as token ids (None: none or empty); a prediction
    longer than the context (``limit`` tokens) is refused, since no reply could follow it."""
    if params.prediction is None:
        return None
    predicted = params.prediction
    if isinstance(predicted, str):
        predicted = tokenizer.encode(predicted, add_special_tokens=False)
    if len(predicted) > limit:
        raise InvalidRequestError(
            f"the prediction ({len(predicted)} tokens) is longer than the context length of {limit} tokens"
        )
    if any(not 0 <= token < vocab for token in predicted):
        raise InvalidRequestError(f"prediction token ids must be in [0, {vocab})")
    return np.asarray(predicted, dtype=np.int64) if predicted else None
