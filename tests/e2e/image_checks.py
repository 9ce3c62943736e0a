"""Run the built images as a cluster would and check what they promise (`make e2e-images`).

    python -m tests.e2e.image_checks server multiguess-server:local
    python -m tests.e2e.image_checks operator multiguess-operator:local multiguess-server:local

Containers use the host's network only (the engine has no bridge) and bind 127.0.0.1. The
serving container runs as the operator's pods do: the image's own user, a read-only root
filesystem, every capability dropped, and writable only where the pod mounts volumes. The
operator container reconciles examples/speculative.yaml against kmock's Kubernetes emulator
(tests/operator/conftest.py), served on 127.0.0.1 by this process. Prints one JSON line of
findings and exits non-zero, saying why, when a promise does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import yaml
from kmock._internal import parsing as kmock_parsing
from multiguess_operator.resources import CACHE_DIR, HF_HOME, RUN_AS, TMP_DIR, USER_CACHE_DIR

from tests.e2e import check_api
from tests.e2e.check_api import CheckFailed, expect

ROOT = Path(__file__).resolve().parents[2]
DOCKER = os.environ.get("DOCKER", "docker")
HARDENED = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
# The image's own HEALTHCHECK command, polled every 2 s instead of 30 s so the check is quick.
QUICK_HEALTH = ["--health-interval", "2s", "--health-start-period", "0s"]


def docker(*args: str, timeout: float = 120) -> str:
    result = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args[:2])} failed: {result.stderr.strip()[-2000:]}")
    return result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def writable(path: str) -> list[str]:
    """A tmpfs at `path` owned by the image's user: what an emptyDir with fsGroup gives a pod."""
    return ["--tmpfs", f"{path}:uid={RUN_AS},gid={RUN_AS},mode=0755"]


def start(image: str, args: list[str]) -> str:
    """A detached container on the host's network; its id."""
    return docker("run", "--detach", "--network", "host", *args, image).strip()


def remove(cid: str, failed: bool) -> None:
    if failed:
        print(docker_logs(cid)[-8000:], file=sys.stderr)
    subprocess.run([DOCKER, "rm", "--force", cid], capture_output=True, check=False)


@contextlib.contextmanager
def container(image: str, args: list[str]) -> Iterator[str]:
    """A detached container, removed on exit; its log is printed when the block fails."""
    cid = start(image, args)
    failed = True
    try:
        yield cid
        failed = False
    finally:
        remove(cid, failed)


def docker_logs(cid: str) -> str:
    """stdout and stderr of a container, together."""
    result = subprocess.run([DOCKER, "logs", cid], capture_output=True, text=True, check=False)
    return result.stdout + result.stderr


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def health(cid: str) -> str:
    return docker("inspect", "--format", "{{.State.Health.Status}}", cid).strip()


def image_facts(image: str) -> dict[str, Any]:
    """The user the image runs as (it must be RUN_AS, not root) and its size."""
    config = json.loads(docker("image", "inspect", image))[0]
    user = config["Config"]["User"]
    expect(user == f"{RUN_AS}:{RUN_AS}", f"{image} runs as {user!r}, not {RUN_AS}:{RUN_AS}")
    return {"image": image, "user": user, "size_mb": round(config["Size"] / 2**20)}


def readme_curls(port: int) -> list[str]:
    """The README tour's curl lines (continuations joined), aimed at `port` instead of 8765."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    (block,) = [b for b in re.findall(r"```bash[^\n]*\n(.*?)```", text, re.S) if "multiguess serve" in b]
    return [line.replace("8765", str(port)) for line in block.splitlines() if line.startswith("curl")]


def run_curl(line: str) -> str:
    """One README line through bash; a failed command or an error body fails the check."""
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True, timeout=300, check=False
    )
    expect(result.returncode == 0 and result.stdout.strip(), f"`{line}` failed: {result.stderr}")
    if result.stdout.lstrip().startswith("{"):
        body = json.loads(result.stdout)
        expect("error" not in body and "detail" not in body, f"`{line}` answered {result.stdout[:300]}")
    return result.stdout


def check_server(image: str) -> dict[str, Any]:
    facts = image_facts(image)
    port = free_port()
    env = {
        "MULTIGUESS_HOST": "127.0.0.1",
        "MULTIGUESS_PORT": str(port),
        "HF_HOME": HF_HOME,
        "XDG_CACHE_HOME": USER_CACHE_DIR,
        "TRITON_CACHE_DIR": f"{USER_CACHE_DIR}/triton",
    }
    args = [*HARDENED, *QUICK_HEALTH, *writable(CACHE_DIR), *writable(TMP_DIR), *writable(USER_CACHE_DIR)]
    args += [item for name, value in env.items() for item in ("--env", f"{name}={value}")]
    base_url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with container(image, args) as cid:
        with httpx.Client(base_url=base_url, timeout=300) as client:
            check_api.wait_ready(client, timeout_s=300)
        facts["ready_s"] = round(time.monotonic() - started, 1)
        uid = docker("exec", cid, "id", "-u").strip()
        expect(uid == str(RUN_AS), f"the server runs as uid {uid}")
        for line in readme_curls(port):
            run_curl(line)
        expect(check_api.main([base_url]) == 0, "the OpenAI client checks failed (see above)")
        wait_for(lambda: health(cid) == "healthy", 60, "the image's HEALTHCHECK to pass")
        logs = docker_logs(cid)
        expect("converting" not in logs, "the first start converted the embedded target")
        expect(
            re.search(r"bf16_kernels \(\w+\) loaded from /opt/multiguess/models", logs) is not None,
            "the server did not load the baked bf16 kernels",
        )
        written = docker("exec", cid, "find", CACHE_DIR, TMP_DIR, USER_CACHE_DIR, "-type", "f").split()
        expect(not [f for f in written if f.endswith((".so", ".safetensors"))], f"start wrote {written}")
        facts["files_written"] = written
    return facts


def check_operator(image: str, server_image: str) -> dict[str, Any]:
    facts = image_facts(image)
    facts.update(asyncio.run(_reconcile_example(image, server_image)))
    return facts


async def _reconcile_example(image: str, server_image: str) -> dict[str, Any]:
    from tests.operator.conftest import (  # the emulator the operator tests use
        DEPLOYMENTS,
        SERVICES,
        SPECDEPLOYS,
        Cluster,
        eventually,
        kubeconfig_text,
        parse_path_with_namespace_list,
        register_resources,
    )

    kmock_parsing.parse_path = parse_path_with_namespace_list
    example = yaml.safe_load((ROOT / "examples" / "speculative.yaml").read_text())
    name, namespace = example["metadata"]["name"], "default"
    example["metadata"]["namespace"] = namespace
    liveness = free_port()
    async with Cluster() as emulator, kmock.Server(emulator, host="127.0.0.1"):
        register_resources(emulator)
        # A node with the example's GPU product, so the operator has nothing to report but pods.
        label = {"nvidia.com/gpu.product": example["spec"]["target"]["gpu"]["product"]}
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node", "labels": label}}
        await emulator._json("POST", "/api/v1/nodes", node)
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(kubeconfig_text(str(emulator.url)))
            kubeconfig.chmod(0o644)
            env = {
                "KUBECONFIG": "/etc/multiguess/kubeconfig",
                "MULTIGUESS_OPERATOR_IMAGE": server_image,
                "MULTIGUESS_OPERATOR_LIVENESS_PORT": str(liveness),
            }
            args = [*HARDENED, *QUICK_HEALTH, *writable(TMP_DIR)]
            args += ["--volume", f"{kubeconfig}:/etc/multiguess/kubeconfig:ro"]
            args += [item for key, value in env.items() for item in ("--env", f"{key}={value}")]
            started = time.monotonic()
            runner = await asyncio.to_thread(start, image, args)
            failed = True
            try:
                await emulator.create(SPECDEPLOYS, example)
                target = await eventually(
                    lambda: emulator.get(DEPLOYMENTS, namespace, f"{name}-target"), 120, "the target"
                )
                await eventually(lambda: emulator.get(SERVICES, namespace, name), 60, "the service")
                pod = target["spec"]["template"]["spec"]
                expect(pod["containers"][0]["image"] == server_image, "the target runs another image")
                children_s = round(time.monotonic() - started, 1)
                await eventually(lambda: _ready(emulator, namespace, name) == "False", 60, "Ready=False")
                ready = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}
                await emulator.patch(DEPLOYMENTS, namespace, f"{name}-target", {"status": ready}, "status")
                await eventually(lambda: _ready(emulator, namespace, name) == "True", 60, "Ready=True")
                await eventually(lambda: _healthy(runner), 60, "the image's HEALTHCHECK")
                status = emulator.get(SPECDEPLOYS, namespace, name)["status"]  # type: ignore[index]
                states = {c["type"]: c["status"] for c in status["conditions"]}
                expect(states == {"Ready": "True", "Progressing": "False", "Degraded": "False"}, f"{status}")
                failed = False
            finally:
                await asyncio.to_thread(remove, runner, failed)
    return {
        "children_s": children_s,
        "children": sorted(emulator.names(DEPLOYMENTS, namespace) | emulator.names(SERVICES, namespace)),
        "conditions": {c["type"]: f"{c['status']} ({c['reason']})" for c in status["conditions"]},
    }


async def _healthy(cid: str) -> bool:
    return await asyncio.to_thread(health, cid) == "healthy"


def _ready(emulator: Any, namespace: str, name: str) -> str | None:
    from tests.operator.conftest import SPECDEPLOYS

    obj = emulator.get(SPECDEPLOYS, namespace, name) or {}
    conditions = (obj.get("status") or {}).get("conditions", [])
    return next((c["status"] for c in conditions if c["type"] == "Ready"), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["server", "operator"])
    parser.add_argument("image")
    parser.add_argument("server_image", nargs="?", default="multiguess-server:local")
    args = parser.parse_args(argv)
    try:
        facts = (
            check_server(args.image)
            if args.which == "server"
            else check_operator(args.image, args.server_image)
        )
    except (CheckFailed, AssertionError, subprocess.TimeoutExpired) as error:
        print(f"{args.which} image check FAILED: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"check": args.which, **facts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
