"""Everything that can be checked before a GPU is touched, all at once, and the plan of the run.

    # Preflight(problems, plan, notes); `eyas preflight CONFIG`
    result = preflight(cfg)
    print(format_preflight(result, cfg))     # exit status 1 when result.problems

Every check runs whatever the others found, so one run lists everything to fix, and every problem
starts with the config field it is about and its value ("target.layer_ids=[2, 4, 50]: ..."):

- the target's config.json (its `text_config` when nested, as Kimi-K2.5's is), read from this
  machine's copy of the target (target.local_dir, else target.checkpoint), against target.layer_ids:
  three capture ids, strictly increasing, each the input of a decoder layer (capture-before id i =
  the input of layer i, 1 .. num_layers - 1: the last layer's output is the final norm's input,
  which SGLang cannot capture), not starting with 1 (SGLang would shift them);
- the drafter against the target: training.draft_vocab_size within the vocabulary, the sizes
  training.drafter leaves to the target present, data.max_length within its positions; a warm
  start's training.init_from there and of the same sizes and capture layers;
- the architecture against what server.backend serves: the patch set's "architectures" for SGLang
  (the patch stage's own check), DeepSeek-V3 for eyas's local server;
- the chat template (tokenizer_config.json's chat_template or chat_template.jinja) when the data
  has conversations, and that the tokenizer loads the way prepare-data loads it (check_tokenizer),
  its code run only with target.trust_remote_code (a refusal names that field);
- the data file (every line when it is small, with prepare's own reader);
- on an SSH server host (check_hosts): reachability, credentials and host key, and the sglang
  version importable by server.python (it needs a patch set), through the Host seam; the local
  copy's config.json against the checkpoint's there (node_config_problems); reachability
  of SSH training hosts. A local host is not checked (a note says so);
- server.dump_dir on the server host (over SSH through the Host seam; a local host here): the free
  space and size of the filesystem holding it against the dump records extraction keeps there at
  once (dump_bytes_needed; a container's /dev/shm is 64 MB unless it was started with --shm-size);
  and whether this machine sees that folder (a probe written through the SSH host, as the
  collector's own: eyas/extraction/records.py): a note says whether records are read here or come
  through SSH, with the record rate the plan's prefill makes;
- SGLang launch arguments that would silently turn capture off: a prefill CUDA-graph backend or a
  --cuda-graph-config prefill backend other than disabled in server.launch_args or
  server.capture_launch_args (capture_flag_problems);
- free disk at extraction.output_dir against the estimated shard bytes (eyas/plan.py);
- the shard folder's read rate on the first training host (a 256 MB probe, page cache dropped, when
  training runs on GPUs) against what the planned training speed reads per node: a note, or a
  problem with training.disk_check=refuse;
- the drafter's training memory per process against plan.gpu_memory_gb when set (less the memory
  model's MEMORY_MARGIN), and the global
  batch against the training sequences.

One module per area of checks (target, drafter, data, hosts, dump_dir, capture, disk, budget); this
one runs them in order and formats the result. Prefect-free: a task can call preflight() and
publish the result.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eyas.config import PipelineConfig
from eyas.plan import SMALL_DATA_BYTES, Plan, make_plan, plan_lines
from eyas.preflight.budget import budget_problems
from eyas.preflight.capture import capture_flag_problems
from eyas.preflight.data import bad_lines_message, checked_tokenizer, count_data
from eyas.preflight.disk import check_disk_rate, existing_parent
from eyas.preflight.drafter import planned_drafter, warm_start_problems
from eyas.preflight.dump_dir import check_dump_dir, check_dump_route
from eyas.preflight.hosts import check_host_access
from eyas.preflight.target import (
    architecture_problems,
    layer_id_problems,
    node_config_problems,
    read_target,
)


@dataclass(frozen=True)
class Preflight:
    problems: list[str]  #: each names its config field and value; empty = go
    plan: Plan
    notes: list[str] = field(default_factory=list)  #: what was skipped or assumed

    @property
    def ok(self) -> bool:
        return not self.problems


def preflight(
    cfg: PipelineConfig,
    *,
    check_hosts: bool = True,
    check_tokenizer: bool = True,
    free_bytes: int | None = None,
    patches_dir: Path | None = None,
    small_data_bytes: int = SMALL_DATA_BYTES,
) -> Preflight:
    """Run every check (see the module docstring). check_hosts=False skips SSH;
    check_tokenizer=False skips loading the tokenizer (its files and chat template are still
    checked); free_bytes replaces the free space measured at extraction.output_dir."""
    from eyas.server.patch_sets import PATCHES_DIR

    patches_dir = Path(patches_dir or PATCHES_DIR)
    problems: list[str] = []
    notes: list[str] = []
    raw, tcfg = read_target(cfg, problems, notes)
    if tcfg is not None:
        problems += layer_id_problems(cfg.target, int(tcfg["num_hidden_layers"]))
    before = len(problems)
    version = check_host_access(cfg, problems, notes, check_hosts, patches_dir)
    if check_hosts and cfg.server.host.kind == "ssh" and len(problems) == before:
        check_dump_route(cfg, tcfg, problems, notes)
    if (
        raw is not None
        and check_hosts
        and cfg.server.host.kind == "ssh"
        and len(problems) == before
    ):
        problems += node_config_problems(cfg, raw)
    problems += capture_flag_problems(cfg)
    if tcfg is not None:
        check_dump_dir(cfg, tcfg, problems, notes, check_hosts)
    if raw is not None:
        problems += architecture_problems(cfg, raw, version, patches_dir)
    dcfg = planned_drafter(cfg, tcfg, problems) if tcfg is not None else None
    if dcfg is not None and cfg.training.init_from is not None:
        problems += warm_start_problems(cfg, dcfg)
    tokenizer, pending = checked_tokenizer(cfg, notes, check_tokenizer)
    count = count_data(cfg, tokenizer, tcfg, problems, pending, small_data_bytes)
    if count is not None:
        notes += _data_notes(cfg, count)
    if free_bytes is None:
        free_bytes = shutil.disk_usage(existing_parent(Path(cfg.extraction.output_dir))).free
    plan = make_plan(cfg, tcfg, count, free_bytes=free_bytes, dcfg=dcfg)
    plan = check_disk_rate(cfg, plan, problems, notes, check_hosts)
    problems += budget_problems(cfg, plan)
    return Preflight(problems, plan, notes)


def _data_notes(cfg: PipelineConfig, count) -> list[str]:
    """What the count of the data says that the plan's figures do not."""
    notes = []
    if count.bad_lines and cfg.data.bad_lines == "skip":
        notes.append(bad_lines_message(cfg, count.bad_lines))
    if not count.conversations:
        notes.append("data.path holds pre-tokenized records only: the chat template is not used")
    if cfg.data.regenerate.enabled:
        notes.append(
            "data.regenerate.enabled: extraction sends the target's own answers; the tokens are "
            "counted on the data's answers"
        )
    return notes


def format_preflight(result: Preflight, cfg: PipelineConfig) -> str:
    lines = [f"plan for {cfg.name}:", *plan_lines(result.plan, cfg)]
    lines += [f"note: {n}" for n in result.notes]
    lines += [f"problem: {p}" for p in result.problems]
    lines.append("preflight: OK" if result.ok else f"preflight: {len(result.problems)} problem(s)")
    return "\n".join(lines)
