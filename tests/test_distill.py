"""`multiguess distill`: the pure pieces, then the whole pipeline on a tiny random target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from multiguess import cli
from multiguess.distill import corpus, prompts
from multiguess.distill.evaluate import chain_tokens_per_step
from multiguess.distill.loss import sampled_topk_soft_cross_entropy, topk_soft_cross_entropy
from multiguess.distill.shards import read_shards
from multiguess.distill.student import projected_embeddings
from multiguess.distill.teacher import Record
from multiguess.distill.train import TrainConfig, epoch_batches, learning_rate
from multiguess.models.draft_vocab import load_draft_vocab

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_loss_value_and_gradient_match_the_plain_formula() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50, requires_grad=True)
    ids = torch.stack([torch.randperm(50)[:4] for _ in range(5)])
    logprobs = torch.log_softmax(torch.randn(5, 4), dim=-1)
    loss = topk_soft_cross_entropy(logits, ids, logprobs)
    loss.backward()
    reference_logits = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(logprobs, dim=-1)
    reference = -(p * torch.log_softmax(reference_logits, dim=-1).gather(1, ids)).sum(1).mean()
    reference.backward()
    assert torch.allclose(loss, reference, atol=1e-5)
    assert torch.allclose(logits.grad, reference_logits.grad, atol=1e-6)


def test_sampled_loss_estimates_the_full_loss() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 8), torch.randn(2000, 8)
    ids = torch.stack([torch.randperm(2000)[:4] for _ in range(64)])
    logprobs = torch.log_softmax(torch.randn(64, 4), dim=-1)
    full = topk_soft_cross_entropy(hidden @ weight.T, ids, logprobs)
    generator = torch.Generator().manual_seed(0)
    estimates = [
        sampled_topk_soft_cross_entropy(hidden, weight, ids, logprobs, 400, generator)[0].item()
        for _ in range(20)
    ]
    assert sum(estimates) / len(estimates) == pytest.approx(full.item(), rel=0.05)
    weight.requires_grad_(True)
    loss, hits = sampled_topk_soft_cross_entropy(hidden, weight, ids, logprobs, 50, generator)
    loss.backward()
    touched = weight.grad.abs().sum(dim=1) > 0
    assert touched[ids.flatten()].all() and touched.sum() < 2000 and hits.shape == (64,)


def test_chain_tokens_per_step() -> None:
    assert chain_tokens_per_step([True] * 8, depth=4) == pytest.approx(8 / 2)  # 4 accepted + bonus, twice
    assert chain_tokens_per_step([False] * 3, depth=4) == 1.0
    assert chain_tokens_per_step([True, False, True], depth=4) == pytest.approx(3 / 2)


def records_of_lengths(lengths: list[int]) -> list[Record]:
    return [
        Record(
            torch.arange(n + 2, dtype=torch.int32), 2, torch.zeros(n, 3, dtype=torch.int32), torch.zeros(n, 3)
        )
        for n in lengths
    ]


def test_epoch_batches_cover_every_record_once_and_are_reproducible() -> None:
    records = records_of_lengths([5, 17, 3, 40, 8, 8, 21, 2, 9, 30])
    batches = epoch_batches(records, tokens_per_step=25, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(records)))
    assert batches == epoch_batches(records, tokens_per_step=25, seed=1, epoch=0)
    assert batches != epoch_batches(records, tokens_per_step=25, seed=1, epoch=1)
    assert all(sum(len(records[i].topk_ids) for i in b[:-1]) < 25 for b in batches)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert learning_rate(config, 0) == pytest.approx(0.1)
    assert learning_rate(config, 9) == pytest.approx(1.0)
    assert learning_rate(config, 55) == pytest.approx(0.55)
    assert learning_rate(config, 100) == pytest.approx(0.1)


def test_projected_embeddings_keep_dot_products() -> None:
    torch.manual_seed(0)
    rank8 = torch.randn(200, 8) @ torch.randn(8, 16)
    reduced = projected_embeddings(rank8, 8)
    assert reduced.shape == (200, 8)
    assert torch.allclose(reduced @ reduced.T, rank8 @ rank8.T, atol=1e-3)
    embeddings = torch.randn(200, 16)
    gram = embeddings @ embeddings.T
    svd = projected_embeddings(embeddings, 8)
    random_basis = torch.linalg.qr(torch.randn(16, 8)).Q
    naive = embeddings @ random_basis
    assert (svd @ svd.T - gram).norm() < (naive @ naive.T - gram).norm()
    with pytest.raises(ValueError, match="exceeds"):
        projected_embeddings(embeddings, 32)


def test_heldout_split_is_by_group_and_stable() -> None:
    every = prompts.template_prompts()
    train, heldout = prompts.split_prompts(every, heldout_fraction=0.1)
    assert len(train) + len(heldout) == len(every) and heldout
    assert not {p.group for p in train} & {p.group for p in heldout}
    assert (train, heldout) == prompts.split_prompts(every, heldout_fraction=0.1)
    assert {p.kind for p in every} == {"chat", "code"}


def test_split_chunks_packs_paragraphs() -> None:
    text = "\n\n".join(f"paragraph {i} " + "word " * 40 for i in range(10))
    chunks = corpus.split_chunks(text, min_chars=300, max_chars=500)
    assert chunks and all(300 <= len(c) <= 500 for c in chunks)
    assert "paragraph 0" in chunks[0]
    assert not corpus.looks_like_prose("0x1f 0x2e | 0x3c | --- | 0x00 0xff ;;; {}[]")


def tiny_target(folder: Path) -> Path:
    """A random 2-layer Llama with a small byte-level BPE tokenizer carrying the chat tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    sample = [p.text for p in prompts.template_prompts()[:400]]
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(wrapped),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(str(folder))
    wrapped.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_target(tmp_path_factory.mktemp("target"))


def test_batched_replies_are_the_targets_own_greedy_replies(target: Path) -> None:
    """Prompts of different lengths decoded together (fp32) match transformers alone, token for
    token, with the teacher's top-k at every reply position."""
    from multiguess.distill.dataset import DataPlan, load_teacher, teacher_runner
    from multiguess.distill.teacher import chat_ids, reply_records

    model, tokenizer = load_teacher(target, "float32")
    plan = DataPlan(batch=4, max_new_tokens=8, k=5)
    questions = ["Hi", "Explain how a hash map works in detail, please.", "Why?", "Write a poem about rain"]
    records = reply_records(teacher_runner(model, tokenizer, target, plan), tokenizer, questions, 8, 5)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for question, record in zip(questions, records, strict=True):
        prompt = chat_ids(tokenizer, question)
        assert record.ids[: record.start].tolist() == prompt
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=eos_id, pad_token_id=eos_id,
        )  # fmt: skip
        expected = out.sequences[0, len(prompt) :].tolist()
        assert record.ids[record.start :].tolist() == expected
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).topk(5, dim=-1)
        assert torch.equal(record.topk_ids, logprobs.indices.to(torch.int32))
        torch.testing.assert_close(record.topk_logprobs.float(), logprobs.values, atol=2e-3, rtol=0)


def text_root(folder: Path) -> Path:
    folder.mkdir()
    prose = "\n\n".join(
        f"The library keeps notes number {i} about many things in plain words. " * 4 for i in range(30)
    )
    (folder / "notes.md").write_text(prose)
    (folder / "code.py").write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}\n" * 6 for i in range(20)))
    return folder


def distill_args(target: Path, tmp_path: Path, stages: str, steps: int) -> list[str]:
    return [
        "distill",
        "--target", str(target),
        "--work", str(tmp_path / "work"),
        "--out", str(tmp_path / "draft"),
        "--text-root", str(tmp_path / "text"),
        "--stages", stages,
        "--data-minutes", "0.001",
        "--gen-batch", "6",
        "--max-new-tokens", "6",
        "--heldout", "6",
        "--layers", "1",
        "--width", "16",
        "--heads", "2",
        "--kv-heads", "1",
        "--intermediate", "32",
        "--steps", str(steps),
        "--tokens-per-step", "32",
    ]  # fmt: skip


def test_pipeline_trains_resumes_and_exports_an_evaluated_draft(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text_root(tmp_path / "text")
    assert cli.main(distill_args(target, tmp_path, "data,train", steps=3)) == 0
    data = tmp_path / "work" / "data"
    heldout, replies, text = (read_shards(data, kind) for kind in ("heldout", "gen", "text"))
    assert len(heldout) == 6 and replies and text
    for record in heldout + replies + text:
        assert len(record.topk_ids) == len(record.ids) - record.start
        assert torch.all(record.topk_logprobs[:, :-1] >= record.topk_logprobs[:, 1:])
    checkpoint = tmp_path / "work" / "train" / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=False)["step"] == 3

    assert cli.main(distill_args(target, tmp_path, "train,export", steps=5)) == 0
    assert "resuming at step 3" in capsys.readouterr().err
    assert torch.load(checkpoint, weights_only=False)["step"] == 5

    out = tmp_path / "draft"
    metrics = json.loads((out / "eval.json").read_text())
    coverage = [metrics[f"top{k}_coverage"] for k in range(1, 5)]
    assert 0 <= metrics["acceptance"] == coverage[0] <= 1
    assert coverage == sorted(coverage)
    assert metrics["positions"] > 0 and metrics["sequences"] == 6
    assert metrics["cost_ratio"] > 0 and math.isfinite(metrics["cost_ratio"])
    assert metrics["chain4_tokens_per_step"] >= 1
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["command"].startswith("multiguess distill") and provenance["trained_steps"] == 5
    assert len(provenance["commands"]) == 2 and "--stages data,train" in provenance["commands"][0]
    assert "## Reproduce" in (out / "PROVENANCE.md").read_text()
    # Its vocabulary: the reply tokens by frequency (the tiny target's vocabulary is smaller
    # than the default 8192, so it is all the tokens the replies used).
    reply_tokens = {t for r in replies for t in r.ids[r.start :].tolist()}
    vocab = load_draft_vocab(str(out), metrics["draft_vocab"] + 1000)
    assert set(vocab.tolist()) == reply_tokens and metrics["draft_vocab"] == len(reply_tokens)
    assert "draft vocabulary of" in (out / "PROVENANCE.md").read_text()
    draft = AutoModelForCausalLM.from_pretrained(str(out))
    assert draft.config.model_type == "llama" and draft.dtype == torch.bfloat16
    assert draft.config.vocab_size == AutoModelForCausalLM.from_pretrained(str(target)).config.vocab_size
    assert (
        AutoTokenizer.from_pretrained(str(out)).get_vocab()
        == AutoTokenizer.from_pretrained(str(target)).get_vocab()
    )


def test_replies_only_when_text_every_is_zero(target: Path, tmp_path: Path) -> None:
    text_root(tmp_path / "text")
    assert cli.main([*distill_args(target, tmp_path, "data", steps=1), "--text-every", "0"]) == 0
    data = tmp_path / "work" / "data"
    assert read_shards(data, "gen") and not read_shards(data, "text")
    with pytest.raises(SystemExit):
        cli.main(["distill", "--text-every", "-1"])


def test_bad_arguments_are_rejected(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["distill", "--stages", "data,bake"])
    assert "stages must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["distill", "--steps", "0"])
    assert cli.main(["distill", "--target", str(tmp_path), "--stages", "train"]) == 2
    assert "not a model folder" in capsys.readouterr().err
    args = distill_args(target, tmp_path, "train", steps=1)
    with pytest.raises(FileNotFoundError, match="data stage first"):
        cli.main(args)


def test_eagle3_pipeline_records_features_resumes_and_exports_a_loadable_head(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--method eagle3``: the data stage adds the target's hidden states at the head's layers
    for every record (transformers' ``output_hidden_states``), training resumes, and the export
    is a ``LlamaForCausalLMEagle3`` head that the checkpoint loader accepts for this target."""
    from multiguess.distill.eagle3_features import read_features
    from multiguess.engine.eagle3_head import default_aux_layers
    from multiguess.models.eagle3_checkpoint import load_head
    from transformers import AutoModelForCausalLM

    text_root(tmp_path / "text")
    method = ["--method", "eagle3", "--ttt-steps", "2"]
    assert cli.main([*distill_args(target, tmp_path, "data,train", steps=3), *method]) == 0
    work = tmp_path / "work"
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    layers = default_aux_layers(model.config.num_hidden_layers)
    for kind in ("heldout", "gen", "text"):
        records, features = read_features(work / "data", work / "eagle3" / "features", kind)
        assert records and len(records) == len(read_shards(work / "data", kind))
        record, feature = records[0], features[0]
        with torch.no_grad():
            states = model(input_ids=record.ids[None].long(), output_hidden_states=True).hidden_states
        expected = torch.cat([states[i][0] for i in layers], dim=-1)
        assert feature.shape == expected.shape
        torch.testing.assert_close(feature.float(), expected, atol=0.05, rtol=0.02)
    checkpoint = work / "eagle3" / "train" / "checkpoint.pt"
    assert torch.load(checkpoint, weights_only=False)["step"] == 3
    log = [json.loads(line) for line in (work / "eagle3" / "train" / "train.log").read_text().splitlines()]
    assert "depth_acceptance" in log[-1]["eval"]

    assert cli.main([*distill_args(target, tmp_path, "train,export", steps=5), *method]) == 0
    assert "resuming at step 3" in capsys.readouterr().err
    assert torch.load(checkpoint, weights_only=False)["step"] == 5
    out = tmp_path / "draft"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    head, embed = load_head(out, model.config, torch.float32)
    assert embed is None and head.config.aux_layers == layers
    metrics = json.loads((out / "eval.json").read_text())
    assert 0 <= metrics["acceptance"] <= 1 and metrics["sequences"] == 6
    assert metrics["chain4_tokens_per_step"] >= 1 and len(metrics["depth_acceptance"]) == 4
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["trained_steps"] == 5 and "--method eagle3" in provenance["command"]


def test_a_resumed_head_keeps_the_vocabulary_it_was_trained_for(tmp_path: Path) -> None:
    """The head scores the records' most frequent tokens; once a checkpoint exists, its own
    (the LM head's rows mean those tokens), even after the data stage added other replies."""
    from types import SimpleNamespace

    from multiguess.distill.eagle3_pipeline import Eagle3Plan, vocabulary_for

    plan = Eagle3Plan(target=tmp_path, work=tmp_path, out=tmp_path / "out", draft_vocab=3)
    reply = SimpleNamespace(ids=torch.tensor([1, 9, 9, 9, 4, 4, 7, 2]), start=1)
    parts = {"gen": ([reply], []), "text": ([], [])}
    assert vocabulary_for(plan, parts, 16).tolist() == [2, 4, 9]  # ties go to the lower id
    trained = torch.tensor([3, 5, 11])
    (plan.folder / "train").mkdir(parents=True)
    torch.save(
        {"model": {"d2t": trained - torch.arange(3)}, "step": 7}, plan.folder / "train" / "checkpoint.pt"
    )
    assert vocabulary_for(plan, parts, 16).tolist() == [3, 5, 11]
