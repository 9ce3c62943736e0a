"""Tenants do not see each other: API keys name tenants, and the prefix cache is scoped by
tenant and by vLLM's ``cache_salt``, so ``cached_tokens`` (and the time a prefill saves)
tells a caller nothing about prompts another tenant sent. The key file's format and the
``serve`` flags, then real servers on 127.0.0.1 with the ``openai`` client and httpx."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from multiguess.api.keys import parse_keys
from multiguess.cli import build_parser
from multiguess.commands.serve import api_keys
from multiguess.engine.config import EngineConfig

from tests.api.conftest import MODEL, LiveServer, tiny_loader
from tests.api.helpers import metric

ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-fedcba9876543210"
HITS = "multiguess_prefix_cache_hit_tokens_total"


# -- the key file and the flags -----------------------------------------------------------------
def test_a_key_file_names_tenants_and_skips_comments_and_blank_lines() -> None:
    text = "# key  tenant\n\n  sk-a1 acme\nsk-a2\tacme  \n   # indented comment\nsk-g globex\nsk-bare\n"
    assert parse_keys(text, "keys.txt") == {
        "sk-a1": "acme",
        "sk-a2": "acme",
        "sk-g": "globex",
        "sk-bare": "default",
    }
    assert parse_keys("sk-only-one\n", "secret") == {"sk-only-one": "default"}  # a one-key Secret


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("sk-1 acme\nsk-2 acme extra\n", "keys.txt, line 2: expected 'KEY [TENANT]', got 3 fields"),
        ("sk-1 acme\n\nsk-1 globex\n", "keys.txt, line 3: the same key as line 1"),
        ("sk-1 -acme\n", "keys.txt, line 1: tenant names are 1-64 letters"),
        ("sk-1 a/b\n", "tenant names"),
        ("sk-clé acme\n", "keys.txt, line 1: a key must be printable ASCII"),
        ("# only comments\n\n", "keys.txt holds no API key"),
    ],
)
def test_a_malformed_key_file_is_refused_with_its_line(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=None) as exc:
        parse_keys(text, "keys.txt")
    assert words in str(exc.value)
    assert "sk-1" not in str(exc.value) and "sk-cl" not in str(exc.value)  # errors never show a key


def serve_args(*argv: str) -> object:
    return build_parser().parse_args(["serve", *argv])


def test_serve_reads_keys_from_a_flag_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{ALICE} alice\n{BOB} bob\n")
    path.chmod(0o600)
    assert api_keys(serve_args()) == {}
    assert api_keys(serve_args("--api-key", ALICE)) == {ALICE: "default"}
    with caplog.at_level(logging.WARNING):
        assert api_keys(serve_args("--api-key-file", str(path))) == {ALICE: "alice", BOB: "bob"}
    assert "readable by every user" not in caplog.text
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        api_keys(serve_args("--api-key-file", str(path)))
    assert "readable by every user" in caplog.text
    monkeypatch.setenv("MULTIGUESS_API_KEY_FILE", str(path))
    assert api_keys(serve_args()) == {ALICE: "alice", BOB: "bob"}
    with pytest.raises(SystemExit, match="not both"):
        api_keys(serve_args("--api-key", ALICE))
    path.write_text(f"{ALICE} alice\n{ALICE} bob\n")
    with pytest.raises(SystemExit, match="line 2: the same key as line 1"):
        api_keys(serve_args())
    monkeypatch.setenv("MULTIGUESS_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="--api-key-file"):
        api_keys(serve_args())


# -- real servers ---------------------------------------------------------------------------------
CONFIG = EngineConfig(num_candidates=3, depth=3, max_nodes=16, max_batch=8, max_model_len=256, adaptive=False)


@pytest.fixture(scope="module")
def tenants(start_server: Callable[..., LiveServer], tiny_llama: Path, tiny_llama_draft: Path) -> LiveServer:
    """Two tenants, one key each."""
    loader = tiny_loader(tiny_llama, tiny_llama_draft, CONFIG)
    return start_server(loader, api_keys={ALICE: "alice", BOB: "bob"})


def client_of(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def system_prompt(seed: int, pin: str = "") -> str:
    """A long system prompt of its own (``seed``), ending in a secret (``pin``)."""
    return " ".join(f"w{(i * 7 + seed) % 50 + 4}" for i in range(60)) + pin


def cached(client: openai.OpenAI, prompt: str, salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True, **extra}
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_a_tenant_reuses_its_own_prompts_and_never_another_tenants(tenants: LiveServer) -> None:
    alice, bob = client_of(tenants, ALICE), client_of(tenants, BOB)
    prompt = system_prompt(1) + " w1 w2"
    assert cached(alice, prompt) == 0
    with tenants.client() as http:
        hits = metric(http, HITS)
        assert cached(bob, prompt) == 0  # Alice's prompt, word for word: Bob computes his own KV
        assert metric(http, HITS) == hits
        assert cached(alice, prompt) >= 60 and cached(bob, prompt) >= 60  # each reuses their own
        assert metric(http, HITS) > hits


def test_cache_salt_separates_requests_of_one_tenant(tenants: LiveServer) -> None:
    alice = client_of(tenants, ALICE)
    prompt = system_prompt(2) + " w3"
    assert cached(alice, prompt, salt="salt-1") == 0
    assert cached(alice, prompt) == 0  # unsalted: another scope
    assert cached(alice, prompt, salt="salt-2") == 0
    assert cached(alice, prompt, salt="salt-1") >= 60  # the same salt shares
    assert cached(client_of(tenants, BOB), prompt, salt="salt-1") == 0  # not across tenants
    chat = alice.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_body={"cache_salt": "salt-3"},
    )
    again = alice.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_body={"cache_salt": "salt-3"},
    )
    assert chat.usage is not None and again.usage is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens > 60  # type: ignore[union-attr,operator]


def test_a_secret_in_another_tenants_prompt_cannot_be_guessed_digit_by_digit(tenants: LiveServer) -> None:
    """The probe that leaked a PIN: send the victim's prefix plus a guessed digit and watch
    ``cached_tokens``. Within one tenant the right guess shows (the probe works); across
    tenants the right guess reads as every wrong one."""
    alice, bob = client_of(tenants, ALICE), client_of(tenants, BOB)
    victim = system_prompt(3) + " w9 w1"  # the secret is the word after the system prompt
    guesses = {digit: system_prompt(3) + f" w{digit} w2" for digit in range(4, 14)}

    def probe(attacker: openai.OpenAI) -> dict[int, int]:
        seen = {}
        for digit, guess in guesses.items():
            cached(alice, victim)  # the victim re-sends its prompt
            seen[digit] = cached(attacker, guess)
        return seen

    within, across = probe(alice), probe(bob)
    assert within[9] == within[4] + 1 and all(within[d] == within[4] for d in guesses if d != 9)
    # Bob's first guess computes the prefix; later ones reuse his own guesses, all alike
    assert across[4] == 0 and len({across[d] for d in guesses if d != 4}) == 1


def test_requests_without_a_valid_key_are_refused_and_health_stays_open(tenants: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        cached(client_of(tenants, "sk-nobody"), "w1 w2")
    with tenants.client() as http:
        assert http.get("/health/ready").status_code == 200
        assert http.get("/v1/models", headers={"authorization": f"Bearer {BOB}"}).status_code == 200


def test_without_keys_one_shared_cache_and_cache_salt_still_separates(server: LiveServer) -> None:
    prompt = system_prompt(4) + " w5"
    with server.client() as http:

        def usage(**extra: object) -> int:
            body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert usage() == 0 and usage() >= 60  # every client one tenant, as before
        assert usage(cache_salt="x") == 0 and usage(cache_salt="x") >= 60
        bad = http.post("/v1/completions", json={"prompt": prompt, "cache_salt": ""})
        assert bad.status_code == 400 and "cache_salt" in bad.text
        bad = http.post("/v1/completions", json={"prompt": prompt, "cache_salt": 5})
        assert bad.status_code == 400 and "cache_salt" in bad.text
