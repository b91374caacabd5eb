"""Shared fixtures: a random tiny DeepSeek-V3 target, and real local servers started on loopback."""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from eyas import net
from eyas.server.hosts import LocalHost

# A random-init DeepSeek-V3 (MLA attention, MoE from layer 1) small enough to load in a second.
TINY_DSV3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=1024,
)


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer: <s>=0, </s>=1 (the config's eos), <unk>=2, then w3..w{V-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    # A plain chat template (every role's words, then </s>), so preflight and prepare-data accept
    # it.
    template = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": template,
            }
        )
    )


@pytest.fixture(scope="session")
def random_target(tmp_path_factory) -> Path:
    """A random tiny DeepSeekV3ForCausalLM folder: many safetensors shards, index,
    tokenizer.json."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("random-target")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY_DSV3))
    model.save_pretrained(folder, max_shard_size="100KB")
    _write_tokenizer(folder, TINY_DSV3["vocab_size"])
    assert len(list(folder.glob("*.safetensors"))) >= 8
    return folder


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listens on (right now)."""
    return net.free_port()


@dataclass
class ServerProc:
    """A local server started through LocalHost, as the pipeline starts it."""

    host: LocalHost
    pid: int
    port: int
    log_path: Path
    dump_dir: Path | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        # bytes, not read_text: text mode would turn tqdm's \r separators into \n
        return self.log_path.read_bytes().decode(errors="replace") if self.log_path.exists() else ""

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        """Block until the log contains needle (or the process died / timeout) and return the
        log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_text()
            if needle in text:
                return text
            if not self.host.is_alive(self.pid):
                raise AssertionError(
                    f"server exited before {needle!r}; log:\n{self.log_text()[-3000:]}"
                )
            time.sleep(0.1)
        raise AssertionError(f"no {needle!r} within {timeout}s; log:\n{self.log_text()[-3000:]}")

    def stop(self) -> None:
        self.host.kill_group(self.pid, 9)


@pytest.fixture(scope="session")
def start_server(random_target, tmp_path_factory):
    """Factory: start_server(*flags, dump=True, name=...) -> ServerProc; all are killed at the
    end."""
    host = LocalHost()
    started: list[ServerProc] = []

    def start(
        *flags: str, dump: bool = False, name: str = "server", model: Path | None = None
    ) -> ServerProc:
        workdir = tmp_path_factory.mktemp(name)
        port = net.free_port()
        dump_dir = workdir / "dump" if dump else None
        # One thread per server: other engineers' tests share these two cores.
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        if dump_dir is not None:
            env["EYAS_DUMP_DIR"] = str(dump_dir)
            env["EYAS_DUMP_DTYPE"] = "float32"  # exact comparison with an in-process forward
        cmd = shlex.join(
            [
                sys.executable,
                "-m",
                "eyas.local.server",
                "--model-path",
                str(model or random_target),
                "--port",
                str(port),
                *flags,
            ]
        )
        pid = host.start(
            cmd, log_path=workdir / "server.log", env=env, cwd=Path(__file__).resolve().parents[1]
        )
        proc = ServerProc(host, pid, port, workdir / "server.log", dump_dir)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (tests/sshd.py); skipped where sshd or root is missing."""
    import os

    from tests.sshd import SSHD, start_sshd

    if not os.path.exists(SSHD) or os.geteuid() != 0:
        pytest.skip("needs openssh-server and root (.ci/run installs it)")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.process.terminate()
    server.process.wait(10)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server for every test that runs flows (about 10 s to start)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        # The heartbeat thread adds a second to every flow run; crash detection is not tested here.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


@pytest.fixture(scope="session")
def exported_drafter(random_target, tmp_path_factory) -> tuple[Path, Path]:
    """(sharpened target, exported drafter folder): a briefly trained drafter in SGLang's format."""
    import torch

    from eyas.config import ExportConfig
    from eyas.evaluation.export import export_drafter
    from eyas.training.train import train_drafter
    from tests.helpers_training import (
        shard_meta,
        sharpen_target,
        target_config,
        training_config,
        write_shards,
    )

    torch.set_num_threads(1)
    target = sharpen_target(random_target, tmp_path_factory.mktemp("sharp-target"))
    shards = write_shards(
        target, tmp_path_factory.mktemp("drafter-shards"), num_shards=1, per_shard=16, length=32
    )
    trained = train_drafter(
        training_config(tmp_path_factory.mktemp("drafter-train"), max_steps=20),
        target_config(target),
        shards,
        log=lambda _: None,
    )
    drafter = export_drafter(
        trained,
        tmp_path_factory.mktemp("drafter-export") / "drafter",
        target=target_config(target),
        export=ExportConfig(dtype="bfloat16"),
        shard_meta=shard_meta(),
    )
    return target, drafter


@pytest.fixture(scope="session")
def sglang_wheel():
    """The sglang 0.5.23 wheel, downloaded once per machine with pip (skips if that fails)."""
    from tests.sglang_wheel import download_wheel

    return download_wheel()


#: Test modules that run deployments on the session's one deployed Prefect server
#: (tests/integration/conftest.py `deployed`): one xdist worker runs them all, so it starts once.
DEPLOYED_SERVER_MODULES = {
    f"tests/integration/{name}.py"
    for name in ("test_deployments", "test_failure_reporting", "test_operator")
}


#: The longest work units, longest first (as one suite run measured them beside each other): the
#: workers start on them, so none is left running alone at the end while the others idle (the rest
#: keep their collection order: the other integration modules, then the short unit tests).
LONGEST_FIRST = [
    "tests/integration/test_sglang_cpu_dsv3.py",
    *sorted(DEPLOYED_SERVER_MODULES),
    "tests/integration/test_pipeline.py",
    "tests/integration/test_serve_bench.py",
    "tests/integration/test_sglang_patch.py",
    "tests/integration/test_flow_extract.py",
    "tests/integration/test_locks.py",
    "tests/integration/test_sglang_cpu.py",
    "tests/integration/test_signals.py",
    "tests/integration/test_worker.py",
    "tests/integration/test_docs_paste.py",
    "tests/integration/test_eyas_run_output.py",
    "tests/integration/test_gpu_host.py",
    "tests/integration/test_ownership.py",
    "tests/integration/test_extract.py",
    "tests/integration/test_safety_secrets.py",
    "tests/integration/test_readiness.py",
    "tests/integration/test_release.py",
]


def pytest_collection_modifyitems(items):
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that the modules sharing the deployed server are one work unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "deployed-prefect-server" if module in DEPLOYED_SERVER_MODULES else module

    return Scheduling(config, log)
