"""Everything that can be checked before a GPU is touched, all at once, and the plan of the run.

    result = preflight(cfg)                  # Preflight(problems, plan, notes); `eyas preflight CONFIG`
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

Prefect-free: a task can call preflight() and publish the result.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from eyas.config import HostConfig, PipelineConfig, TargetConfig
from eyas.plan import GB, MEMORY_MARGIN, SMALL_DATA_BYTES, DataCount, Plan, count_tokens, make_plan, on_gpu, plan_lines, processes

# eyas/local/engine.py builds the model with transformers' AutoModelForCausalLM and captures the
# states of DeepSeek-V3's decoder layers (its expert weights fused the DeepSeek-V3 way).
LOCAL_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SGLANG_VERSION_CODE = 'import importlib.metadata as m; print(m.version("sglang"))'
#: shards the extract flow works on at once (flows/extract.py, ThreadPoolTaskRunner(max_workers=2)):
#: each keeps up to extraction.collect_workers answered sequences' dump records while writing them
SHARDS_AT_ONCE = 2
#: SGLang 0.5.23 flags that choose the prefill CUDA graph (arg_groups/fields/exec_.py), with the
#: shortest prefix argparse takes for each (its parser allows abbreviations; nothing else starts so)
PREFILL_GRAPH_BACKEND = ("--cuda-graph-backend-prefill", "--cuda-graph-backend-p")
GRAPH_CONFIG = ("--cuda-graph-config", "--cuda-graph-c")


@dataclass(frozen=True)
class Preflight:
    problems: list[str]  #: each names its config field and value; empty = go
    plan: Plan
    notes: list[str] = field(default_factory=list)  #: what was skipped or assumed

    @property
    def ok(self) -> bool:
        return not self.problems


def preflight(cfg: PipelineConfig, *, check_hosts: bool = True, check_tokenizer: bool = True,
              free_bytes: int | None = None, patches_dir: Path | None = None,
              small_data_bytes: int = SMALL_DATA_BYTES) -> Preflight:
    """Run every check (see the module docstring). check_hosts=False skips SSH; check_tokenizer=False
    skips loading the tokenizer (its files and chat template are still checked); free_bytes replaces
    the free space measured at extraction.output_dir."""
    from eyas.server.sglang_patch import PATCHES_DIR

    patches_dir = Path(patches_dir or PATCHES_DIR)
    problems: list[str] = []
    notes: list[str] = []
    raw, tcfg = _read_target(cfg, problems, notes)
    if tcfg is not None:
        problems += layer_id_problems(cfg.target, int(tcfg["num_hidden_layers"]))
    before = len(problems)
    version = _check_hosts(cfg, problems, notes, check_hosts, patches_dir)
    if check_hosts and cfg.server.host.kind == "ssh" and len(problems) == before:
        _check_dump_route(cfg, tcfg, problems, notes)
    if raw is not None and check_hosts and cfg.server.host.kind == "ssh" and len(problems) == before:
        problems += node_config_problems(cfg, raw)
    problems += capture_flag_problems(cfg)
    if tcfg is not None:
        _check_dump_dir(cfg, tcfg, problems, notes, check_hosts)
    if raw is not None:
        problems += architecture_problems(cfg, raw, version, patches_dir)
    dcfg = _drafter(cfg, tcfg, problems) if tcfg is not None else None
    if dcfg is not None and cfg.training.init_from is not None:
        problems += _warm_start(cfg, dcfg)
    tokenizer, pending = _tokenizer(cfg, notes, check_tokenizer)
    count = _count(cfg, tokenizer, tcfg, problems, pending, small_data_bytes)
    if count is not None and count.bad_lines and cfg.data.bad_lines == "skip":
        notes.append(bad_lines_message(cfg, count.bad_lines))
    if count is not None and not count.conversations:
        notes.append("data.path holds pre-tokenized records only: the chat template is not used")
    if count is not None and cfg.data.regenerate.enabled:
        notes.append("data.regenerate.enabled: extraction sends the target's own answers; the tokens are "
                     "counted on the data's answers")
    if free_bytes is None:
        free_bytes = shutil.disk_usage(_existing_parent(Path(cfg.extraction.output_dir))).free
    plan = make_plan(cfg, tcfg, count, free_bytes=free_bytes, dcfg=dcfg)
    plan = _check_disk(cfg, plan, problems, notes, check_hosts)
    problems += _budget_problems(cfg, plan)
    return Preflight(problems, plan, notes)


def format_preflight(result: Preflight, cfg: PipelineConfig) -> str:
    lines = [f"plan for {cfg.name}:", *plan_lines(result.plan, cfg)]
    lines += [f"note: {n}" for n in result.notes]
    lines += [f"problem: {p}" for p in result.problems]
    lines.append("preflight: OK" if result.ok else f"preflight: {len(result.problems)} problem(s)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the target

def target_field(cfg: PipelineConfig) -> str:
    """The field naming this machine's copy of the target: target.local_dir, else target.checkpoint."""
    t = cfg.target
    return f"target.local_dir={t.local_dir}" if t.local_dir is not None else f"target.checkpoint={t.checkpoint}"


def _read_target(cfg: PipelineConfig, problems: list[str], notes: list[str]) -> tuple[dict | None, dict | None]:
    """(config.json as written, the text config eyas reads) from the target's local copy
    (target.local_dir, else target.checkpoint), or Nones with the problem recorded."""
    from eyas.target import local_copy, read_config

    folder, where = local_copy(cfg.target), target_field(cfg)
    remote = cfg.server.host.kind == "ssh" and cfg.target.local_dir is None
    try:
        tcfg = read_config(folder)
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        hint = (f"; the server host {cfg.server.host.hostname} is reached over SSH: set target.local_dir to this "
                f"machine's copy of the target's config.json, tokenizer files and chat template (no weights)"
                if remote else "")
        problems.append(f"{where}: {e} (prepare-data, preflight and the export read the target's config.json "
                        f"and tokenizer on this machine{hint})")
        return None, None
    if remote:
        notes.append(f"target.local_dir=None: the target's config and tokenizer are read at target.checkpoint="
                     f"{cfg.target.checkpoint} on this machine (the same path as on {cfg.server.host.hostname})")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not isinstance(tcfg.get(k), int)]
    if missing:
        where_in = "text_config" if "text_config" in raw else "config.json"
        problems.append(f"{where}: its {where_in} has no integer {', '.join(missing)}")
        return raw, None
    return raw, tcfg


#: what the orchestrator's copy of the target must agree on with the checkpoint the server loads
NODE_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


def node_config_problems(cfg: PipelineConfig, raw: dict) -> list[str]:
    """This machine's copy of config.json (raw) against the checkpoint's on the SSH server host:
    architectures, hidden size, layers and vocabulary (the text config's when nested)."""
    ckpt = cfg.target.checkpoint
    problems: list[str] = []
    r = _run_on(cfg.server.host, "server.host", f"cat {shlex.quote(str(ckpt).rstrip('/') + '/config.json')}",
                problems)
    if r is None:
        return problems
    host = cfg.server.host.hostname
    if not r.ok:
        return [f"target.checkpoint={ckpt}: no config.json there on {host} (exit {r.exit_code}): "
                f"{r.stderr.strip()[-300:]}"]
    try:
        theirs = json.loads(r.stdout)
    except ValueError as e:
        return [f"target.checkpoint={ckpt}: its config.json on {host} is not JSON ({e})"]

    def summary(c: dict) -> dict:
        text = c.get("text_config", c) if "hidden_size" not in c else c
        archs = c.get("architectures") or text.get("architectures")
        return {"architectures": archs, **{k: text.get(k) for k in NODE_CONFIG_KEYS}}

    ours, node = summary(raw), summary(theirs)
    differ = [f"{k} {ours[k]} here, {node[k]} there" for k in ours if ours[k] != node[k]]
    if differ:
        problems.append(f"{target_field(cfg)}: its config.json is not the target's: target.checkpoint={ckpt} on "
                        f"{host} has another ({'; '.join(differ)}); copy the checkpoint's config.json, tokenizer "
                        f"files and chat template here again")
    return problems


def layer_id_problems(target: TargetConfig, num_layers: int) -> list[str]:
    """target.layer_ids against a target of num_layers decoder layers (capture-before, sglang.md section 1)."""
    ids, capture = list(target.layer_ids), target.capture_ids()
    where = f"target.layer_ids={ids}"
    if target.layer_convention == "output-of":
        where += f" (target.layer_convention=output-of: capture ids {capture})"
    out = []
    if len(ids) != 3:
        out.append(f"{where}: SGLang's EAGLE-3 drafter fuses exactly 3 layers, got {len(ids)}")
    if any(b <= a for a, b in itertools.pairwise(ids)):
        out.append(f"{where}: the ids must be strictly increasing")
    bad = [i for i in capture if not 1 <= i <= num_layers - 1]
    if bad:
        out.append(f"{where}: capture id(s) {bad} out of range for the target's {num_layers} layers: capture id i "
                   f"is the input of decoder layer i, so ids go from 1 to {num_layers - 1} (the last layer's "
                   f"output is the final norm's input, which SGLang cannot capture)")
    elif capture and capture[0] == 1:
        out.append(f"{where}: capture ids starting with 1 are read by SGLang as output-of ids and shifted to "
                   f"{[i + 1 for i in capture]}; choose a first capture id of 2 or more")
    return out


def architecture_problems(cfg: PipelineConfig, raw: dict, version: str | None, patches_dir: Path) -> list[str]:
    """The target's architecture against what the backend serves: the patch set's manifest for
    SGLang (the patch stage's own check, eyas/server/sglang_patch.py), DeepSeek-V3 for eyas-local."""
    from eyas.server.sglang_patch import PatchError, available_versions, check_architecture

    archs = raw.get("architectures") or (raw.get("text_config") or {}).get("architectures") or []
    source = f"{target_field(cfg)} (config.json)"
    if cfg.server.backend == "local":
        if archs and archs[0] in LOCAL_ARCHITECTURES:
            return []
        return [f"{source}: architectures {archs or 'missing'} cannot be served by server.backend=local "
                f"(eyas's local server loads {list(LOCAL_ARCHITECTURES)})"]
    versions = [version] if version else available_versions(patches_dir)
    problems = []
    for v in versions:  # without the host's version: every patch set eyas ships must take it
        try:
            check_architecture(v, archs, source, patches_dir, capture=cfg.server.capture)
        except PatchError as e:
            problems.append(f"{e} (server.backend=sglang)")
        except (OSError, ValueError):
            continue  # no patch set for that version: the host check reports it
    return problems


def _drafter(cfg: PipelineConfig, tcfg: dict, problems: list[str]):
    """The DrafterConfig training will build (eyas/training/train.py drafter_config), or None."""
    from eyas.training.train import drafter_config

    t, vocab = cfg.training, int(tcfg["vocab_size"])
    positions = tcfg.get("max_position_embeddings")
    if isinstance(positions, int) and cfg.data.max_length > positions:
        problems.append(f"data.max_length={cfg.data.max_length}: longer than the target's "
                        f"max_position_embeddings ({positions})")
    if t.draft_vocab_size > vocab:
        problems.append(f"training.draft_vocab_size={t.draft_vocab_size}: larger than the target's vocabulary "
                        f"({vocab}, vocab_size in target.checkpoint's config)")
        return None
    try:
        return drafter_config(t, tcfg, int(tcfg["hidden_size"]), len(cfg.target.layer_ids))
    except KeyError as e:
        problems.append(f"training.drafter: {e.args[0]} is not set and target.checkpoint's config has none")
    except ValueError as e:
        problems.append(f"training.drafter={t.drafter.model_dump(exclude_none=True)}: {e}")
    return None


def _warm_start(cfg: PipelineConfig, dcfg) -> list[str]:
    """training.init_from: there, a drafter or checkpoint, of this run's sizes and capture layers."""
    from eyas.training.warm_start import init_problems, init_source

    try:
        source = init_source(cfg.training.init_from, cfg.training.output_dir)
        return init_problems(source, dcfg, cfg.target.capture_ids())
    except (ValueError, OSError, KeyError) as e:
        return [str(e)]


# ----------------------------------------------------------------------------- data

def _tokenizer_field(cfg: PipelineConfig) -> str:
    t = cfg.target
    return (f"target.local_dir={t.local_dir}" if t.local_dir is not None
            else f"target.local_dir=None (target.checkpoint={t.checkpoint})")


def has_chat_template(folder: Path) -> bool:
    """tokenizer_config.json's chat_template, or a chat_template.jinja beside it."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _tokenizer(cfg: PipelineConfig, notes: list[str], check: bool) -> tuple[object | None, list[str]]:
    """(the tokenizer loaded as prepare loads it or None, its problems): the problems count only when
    the data has conversations (a pre-tokenized file needs neither tokenizer nor template)."""
    from eyas.target import local_copy

    folder = local_copy(cfg.target)
    where = _tokenizer_field(cfg)
    pending = []
    if not (folder / "tokenizer_config.json").is_file() and not (folder / "tokenizer.json").is_file():
        pending.append(f"{where}: no tokenizer_config.json or tokenizer.json in {folder}")
    elif not has_chat_template(folder):
        pending.append(f"{where}: no chat template in {folder} (tokenizer_config.json chat_template or "
                       f"chat_template.jinja); conversations cannot be rendered or masked without one")
    tok = None
    if not pending and check:
        from eyas.target import RemoteCodeRefused, load_tokenizer, trust_remote_code

        trust = trust_remote_code(cfg)
        try:
            tok = load_tokenizer(folder, trust_remote_code=trust)
        except RemoteCodeRefused as e:
            pending.append(f"target.trust_remote_code={cfg.target.trust_remote_code} (server.backend="
                           f"{cfg.server.backend}): {e}")
        except Exception as e:  # noqa: BLE001 - whatever transformers raises, prepare-data would too
            pending.append(f"{where}: the tokenizer does not load as prepare-data loads it "
                           f"(eyas/target.py load_tokenizer): {type(e).__name__}: {' '.join(str(e).split())[:400]}")
    elif not pending:
        notes.append(f"tokenizer not loaded (check_tokenizer=False): {folder} has its files and a chat "
                     f"template; tokens are estimated")
    return tok, pending


def _count(cfg: PipelineConfig, tokenizer, tcfg: dict | None, problems: list[str], pending: list[str],
           small_bytes: int) -> DataCount | None:
    vocab = int(tcfg["vocab_size"]) if tcfg is not None else None
    try:
        count = count_tokens(cfg.data, tokenizer, vocab_size=vocab, small_bytes=small_bytes)
    except Exception as e:  # noqa: BLE001 - DataError, or a template that fails on a record
        problems += pending  # unknown content: assume conversations
        problems.append(f"data.path={cfg.data.path}: {e}")
        return None
    if count.conversations:
        problems += pending
    if count.bad_lines and cfg.data.bad_lines == "error":
        problems.append(bad_lines_message(cfg, count.bad_lines))
    return count


MAX_LISTED_BAD_LINES = 20


def bad_lines_message(cfg: PipelineConfig, bad: tuple[str, ...] | list[str]) -> str:
    """Every bad line of data.path counted, the first MAX_LISTED_BAD_LINES named, and what eyas does."""
    shown = "\n    ".join(bad[:MAX_LISTED_BAD_LINES])
    more = f"\n    ... and {len(bad) - MAX_LISTED_BAD_LINES} more" if len(bad) > MAX_LISTED_BAD_LINES else ""
    what = ("data.bad_lines: error stops at the first; fix them, or set data.bad_lines: skip to drop them"
            if cfg.data.bad_lines == "error" else "data.bad_lines: skip drops them, counted in report.json's data")
    return f"data.path={cfg.data.path}: {len(bad)} bad line(s) ({what}):\n    {shown}{more}"


# ----------------------------------------------------------------------------- hosts

def _run_on(hcfg: HostConfig, where: str, command: str, problems: list[str], env: dict | None = None):
    """The RunResult of command on the host, or None with a problem naming the host's fields."""
    from eyas.server.hosts import HostAuthError, HostError, HostUnreachable, make_host

    try:
        host = make_host(hcfg)
    except OSError as e:  # e.g. the known_hosts file is missing
        problems.append(f"{where}.known_hosts={hcfg.known_hosts}: cannot be read ({e})")
        return None
    try:
        return host.run(command, check=False, timeout=120, env=env)
    except HostAuthError as e:
        problems.append(f"{where}.hostname={hcfg.hostname}: {hcfg.user or ''}@{hcfg.hostname}:{hcfg.port} refused "
                        f"{where}.key_filename={hcfg.key_filename}, or its host key is not in "
                        f"{where}.known_hosts={hcfg.known_hosts} ({e})")
    except HostUnreachable as e:
        problems.append(f"{where}.hostname={hcfg.hostname}: unreachable on {where}.port={hcfg.port} ({e})")
    except HostError as e:
        problems.append(f"{where}.hostname={hcfg.hostname}: {e}")
    finally:
        host.close()
    return None


def _check_hosts(cfg: PipelineConfig, problems: list[str], notes: list[str], check: bool,
                 patches_dir: Path) -> str | None:
    """The sglang version on an SSH server host (None when not asked or not found)."""
    s = cfg.server
    if s.host.kind != "ssh":
        notes.append("server.host.kind=local: no SSH or SGLang version check (the server runs on this machine)")
        return None
    if not check:
        notes.append("host checks skipped (check_hosts=False): SSH reachability, host keys and the SGLang "
                     "version were not checked")
        return None
    from eyas.server.sglang_patch import available_versions, server_python

    python = server_python(cfg)
    code = SGLANG_VERSION_CODE if s.backend == "sglang" else "import eyas"
    r = _run_on(s.host, "server.host", f"{shlex.quote(python)} -c {shlex.quote(code)}", problems, env=s.env)
    version = None
    if r is not None and not r.ok:
        what = "report sglang's version" if s.backend == "sglang" else "import eyas"
        problems.append(f"server.python={python}: cannot {what} on {s.host.hostname} (exit {r.exit_code}): "
                        f"{r.stderr.strip()[-300:]}")
    elif r is not None and s.backend == "sglang":
        version = (r.stdout.strip().splitlines() or [""])[-1]
        if version not in available_versions(patches_dir):
            problems.append(f"server.python={python}: sglang {version} on {s.host.hostname} has no eyas patch set "
                            f"(patches/sglang/ has {available_versions(patches_dir)})")
            version = None
    for i, h in enumerate(cfg.training.distributed.hosts):
        if h.kind == "ssh":
            _run_on(h, f"training.distributed.hosts.{i}", "true", problems)
    return version


# ----------------------------------------------------------------------------- capture

def _is_flag(name: str, flag: tuple[str, str]) -> bool:
    """name (before any "=") is the flag or an abbreviation argparse would take for it."""
    full, shortest = flag
    return full.startswith(name) and len(name) >= len(shortest)


def capture_flag_problems(cfg: PipelineConfig) -> list[str]:
    """Arguments of the capture launch (server.launch_args, server.capture_launch_args) that turn
    SGLang's prefill CUDA graph back on. The capture launch passes --disable-prefill-cuda-graph
    because eyas's dump hook (and a source-patched model file) run only in eager forwards: a replayed
    graph skips the Python code, so its requests come back without dump records. In 0.5.23 an
    explicit --cuda-graph-backend-prefill, and a --cuda-graph-config JSON naming a prefill backend,
    both win over --disable-prefill-cuda-graph whatever their order (model_executor/
    cuda_graph_config.py, arg_groups/cuda_graph_hook.py _parse_cuda_graph_config)."""
    s = cfg.server
    if s.backend != "sglang":
        return []
    out = []
    for where, args in (("server.launch_args", s.launch_args), ("server.capture_launch_args", s.capture_launch_args)):
        fix = ("move it to benchmark.launch_args, which only the serving launches get" if where == "server.launch_args"
               else "remove it")
        for i, token in enumerate(args):
            if not token.startswith("--"):
                continue
            name, eq, value = token.partition("=")
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            if _is_flag(name, PREFILL_GRAPH_BACKEND):
                backend = value
            elif _is_flag(name, GRAPH_CONFIG):
                try:
                    phase = json.loads(value).get("prefill")
                except (ValueError, AttributeError):
                    out.append(f"{where}: {name} {value!r} is not a JSON object, so whether it turns SGLang's "
                               f"prefill CUDA graph on (and capture off) cannot be told; {fix}")
                    continue
                backend = phase.get("backend", "disabled") if isinstance(phase, dict) else "disabled"
            else:
                continue
            if backend != "disabled":
                out.append(f"{where}: {name} {value} sets SGLang's prefill CUDA graph backend to {backend!r}, over the "
                           f"capture launch's --disable-prefill-cuda-graph; eyas's dump hook (and a source-patched "
                           f"model) run only in eager forwards, so graph-replayed prefills would write no dump "
                           f"records and every extraction request would time out; {fix}")
    return out


#: bytes per element of each extraction.dtype (the dump records' dtype)
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
#: prints the nearest existing folder at or above the path, then its filesystem's `df -P` row
_DF_SCRIPT = ('p={path}; while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done; '
              'printf "%s\\n" "$p"; df -Pk "$p" | tail -n 1')
_DF_ROW = re.compile(r"\s(\d+)\s+(\d+)\s+(\d+)\s+\d+%\s")  # 1024-blocks, used, available, capacity


def dump_bytes_needed(cfg: PipelineConfig, hidden_size: int) -> tuple[int, int, int]:
    """(bytes, sequences, bytes per token): the most dump records server.dump_dir holds at once during
    extraction. Every sequence in flight (extraction.concurrency) writes one record per prefill
    chunk, and an answered one keeps them until its shard has written it (extraction.collect_workers
    per shard, SHARDS_AT_ONCE shards); each record holds the aux layers and the last hidden state in
    extraction.dtype plus an int32 id per token (eyas/dump.py): ~235 MB for 4,096 tokens at H=7168."""
    x = cfg.extraction
    per_token = (len(cfg.target.layer_ids) + 1) * hidden_size * _ITEMSIZE[x.dtype] + 4
    sequences = x.concurrency + SHARDS_AT_ONCE * x.collect_workers
    return sequences * cfg.data.max_length * per_token, sequences, per_token


def _check_dump_dir(cfg: PipelineConfig, tcfg: dict, problems: list[str], notes: list[str], check: bool) -> None:
    """server.dump_dir's filesystem on the server host against dump_bytes_needed."""
    s, x = cfg.server, cfg.extraction
    if s.host.kind == "ssh" and not check:
        notes.append(f"server.dump_dir={s.dump_dir}: free space on {s.host.hostname} not checked (check_hosts=False)")
        return
    hidden = int(tcfg["hidden_size"])
    need, sequences, per_token = dump_bytes_needed(cfg, hidden)
    unreached: list[str] = []
    r = _run_on(s.host, "server.host", _DF_SCRIPT.format(path=shlex.quote(str(s.dump_dir))), unreached)
    if r is None:  # an SSH host's version check has reported the same failure already
        problems += unreached if s.host.kind != "ssh" else []
        return
    lines = r.stdout.strip().splitlines()
    row = _DF_ROW.search(f" {lines[-1]} ") if r.ok and len(lines) >= 2 else None
    if row is None:
        notes.append(f"server.dump_dir={s.dump_dir}: its free space could not be read on {s.host.name} "
                     f"(df -Pk, exit {r.exit_code}: {(r.stderr or r.stdout).strip()[-200:]})")
        return
    folder, size, free = lines[0], int(row[1]) * 1024, int(row[3]) * 1024
    if free >= need:
        return
    why = (f"server.dump_dir={s.dump_dir}: {folder} on {s.host.name} has {free:,} bytes ({free / GB:,.2f} GB) free "
           f"of {size / GB:,.2f} GB, but extraction keeps up to {need:,} bytes ({need / GB:,.2f} GB) of dump records "
           f"there: {sequences} sequences (extraction.concurrency={x.concurrency} + {SHARDS_AT_ONCE} shards x "
           f"extraction.collect_workers={x.collect_workers}) of up to data.max_length={cfg.data.max_length} tokens "
           f"x {per_token:,} B per token ({len(cfg.target.layer_ids)} aux layers + the last, hidden {hidden}, "
           f"extraction.dtype={x.dtype}); ")
    if size < need:
        why += ("the filesystem itself is smaller than that (a container's /dev/shm is 64 MB unless it was started "
                "with --shm-size): enlarge it (docker run --shm-size, or mount -o remount,size=... on the host), "
                "point server.dump_dir at a larger tmpfs, or lower extraction.concurrency")
    else:
        why += "free space there (an earlier run's dump folders?) or lower extraction.concurrency"
    problems.append(why)


# ----------------------------------------------------------------------------- disk and memory

def _check_dump_route(cfg: PipelineConfig, tcfg: dict | None, problems: list[str], notes: list[str]) -> None:
    """How extraction will read server.dump_dir's records from this machine: a probe file written
    through the SSH host, looked for here (eyas/extraction/records.py, the collector's own probe)."""
    from eyas.extraction.records import probe_visible
    from eyas.server.hosts import HostError, make_host

    s = cfg.server
    host = make_host(s.host)
    try:
        visible, folder = probe_visible(host, s.dump_dir)
    except HostError as e:
        problems.append(f"server.dump_dir={s.dump_dir}: cannot write a file in it (or its nearest existing "
                        f"folder) on {s.host.name}: {e}")
        return
    finally:
        host.close()
    if visible:
        notes.append(f"server.dump_dir={s.dump_dir}: {folder} on {s.host.name} is the same folder here: "
                     f"extraction reads the dump records on this machine")
        return
    rate = ""
    if tcfg is not None:
        per_token = dump_bytes_needed(cfg, int(tcfg["hidden_size"]))[2]
        rate = (f"; plan.prefill_tokens_per_s={cfg.plan.prefill_tokens_per_s:g} makes "
                f"{per_token * cfg.plan.prefill_tokens_per_s / 1e6:,.0f} MB/s of records per server")
    notes.append(f"server.dump_dir={s.dump_dir}: not visible on this machine, so extraction reads the dump "
                 f"records through SSH from {s.host.name} (100-180 MB/s per connection on loopback, "
                 f"{cfg.extraction.collect_workers + 1} connections{rate}); a Prefect worker on the node reads "
                 f"them at file speed (docs/production.md)")


# ----------------------------------------------------------------------------- the shards' disk

#: bytes the disk probe reads (a few hundred MB: past any disk's own cache, a second or so)
DISK_PROBE_BYTES = 256 << 20
#: the probe, stdlib only (it runs on the training host, under its python): the largest shard in the
#: folder, else a temp file it writes there (and removes), read once with its pages dropped from the
#: page cache before (posix_fadvise DONTNEED: no privileges needed) -> one JSON line
DISK_PROBE_CODE = r"""
import json, os, sys, tempfile, time
folder, want = sys.argv[1], int(sys.argv[2])
shards = sorted((e.stat().st_size, e.path) for e in os.scandir(folder) if e.name.endswith(".safetensors")
                and e.is_file()) if os.path.isdir(folder) else []
temp = None
if shards and shards[-1][0] >= want // 4:
    path = shards[-1][1]
else:
    fd, temp = tempfile.mkstemp(prefix=".eyas-disk-probe-", dir=folder)
    block = os.urandom(1 << 20)
    for _ in range(want >> 20):
        os.write(fd, block)
    os.close(fd)
    path = temp
try:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buf, done = bytearray(16 << 20), 0
    t0 = time.perf_counter()
    while done < want:
        got = os.preadv(fd, [memoryview(buf)[:min(len(buf), want - done)]], done)
        if got <= 0:
            break
        done += got
    seconds = time.perf_counter() - t0
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
finally:
    if temp:
        os.unlink(temp)
print(json.dumps({"bytes_per_s": done / max(seconds, 1e-9), "bytes": done, "file": path, "temp": bool(temp)}))
"""


def _check_disk(cfg: PipelineConfig, plan: Plan, problems: list[str], notes: list[str], check: bool) -> Plan:
    """The shard folder's read rate on the (first) training host against the plan's need (plan.read_bytes_per_s),
    per training.disk_check: "warn" a note, "refuse" a problem, "off" no probe."""
    import dataclasses
    import sys

    t = cfg.training
    if plan.read_bytes_per_s is None:
        return plan
    if t.disk_check == "off":
        return dataclasses.replace(plan, disk_probe="not probed: training.disk_check=off")
    if not on_gpu(cfg):  # a CPU step reads a few MB/s
        return dataclasses.replace(plan, disk_probe="not probed: training on the CPU")
    hosts = t.distributed.hosts
    remote = bool(hosts) and hosts[0].kind == "ssh"
    if remote and not check:
        return dataclasses.replace(plan, disk_probe="not probed: host checks skipped")
    folder = Path(cfg.extraction.output_dir)
    if not remote:
        folder = _existing_parent(folder)
    python = t.distributed.python or ("python3" if remote else sys.executable)
    # on a remote host the folder may not exist yet: probe its nearest existing parent there
    where = shlex.quote(str(folder))
    command = (f"d={where}; while [ ! -d \"$d\" ]; do d=$(dirname \"$d\"); done; "
               f"{shlex.quote(python)} -c {shlex.quote(DISK_PROBE_CODE)} \"$d\" {DISK_PROBE_BYTES}")
    if remote:
        r = _run_on(hosts[0], "training.distributed.hosts.0", command, problems)
        name = hosts[0].hostname or hosts[0].name
    else:
        from eyas.server.hosts import LocalHost
        r, name = LocalHost().run(command, check=False, timeout=120), "this machine"
    try:
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r is not None and r.ok else None
    except (ValueError, IndexError):
        got = None
    if got is None:
        notes.append(f"extraction.output_dir={cfg.extraction.output_dir}: the disk probe failed on {name}"
                     + (f" (exit {r.exit_code}: {r.stderr.strip()[-300:]})" if r is not None else ""))
        return dataclasses.replace(plan, disk_probe=f"probe failed on {name}")
    rate = float(got["bytes_per_s"])
    plan = dataclasses.replace(plan, disk_bytes_per_s=rate, disk_probe=(
        f"{got['bytes'] / 1e6:,.0f} MB of {'a temp file' if got['temp'] else got['file']} on {name}, page cache "
        f"dropped"))
    if rate < plan.read_bytes_per_s:
        x = cfg.extraction
        msg = (f"extraction.output_dir={x.output_dir}: training reads {plan.read_bytes_per_s / GB:,.2f} GB/s of shards "
               f"per node at plan.train_tokens_per_s={cfg.plan.train_tokens_per_s:g} x {t.distributed.nproc_per_node} "
               f"process(es), but the folder read {rate / GB:,.2f} GB/s on {name} from disk: steps would wait "
               f"for data once the shards are not in the page cache. Use extraction.encoding=fp8_e4m3 (half "
               f"the bytes), keep the shards in the page cache (host memory above their size), or put them "
               f"on local NVMe (docs/training.md, \"Reading the shards\")")
        (problems if t.disk_check == "refuse" else notes).append(
            msg + ("" if t.disk_check == "refuse" else " (training.disk_check=warn)"))
    return plan


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _budget_problems(cfg: PipelineConfig, plan: Plan) -> list[str]:
    out, x, t = [], cfg.extraction, cfg.training
    if plan.total_bytes is not None and plan.free_bytes is not None:
        reserve = x.keep_free_gb * 1e9
        if plan.free_bytes < plan.total_bytes + reserve:
            out.append(f"extraction.output_dir={x.output_dir}: the shards need {plan.total_bytes / 1e9:,.2f} GB and "
                       f"extraction.keep_free_gb={x.keep_free_gb} must stay free, but "
                       f"{_existing_parent(Path(x.output_dir))} has {plan.free_bytes / 1e9:,.2f} GB free; free space, "
                       f"point it elsewhere, or set extraction.encoding=fp8_e4m3 (about half the bytes)")
    used, limit = plan.train_memory_gb, plan.gpu_memory_gb
    # the estimate is within MEMORY_MARGIN of the measured peaks, either way: keep that much free
    usable = limit * (1 - MEMORY_MARGIN) if limit is not None else None
    if used is not None and usable is not None and on_gpu(cfg) and used > usable:
        per_seq = dict(plan.memory_gb)["activations"] / t.batch_size
        fits = int((usable - (used - per_seq * t.batch_size)) // per_seq) if per_seq else 0
        out.append(f"training.batch_size={t.batch_size}: the drafter's training needs about {used:,.1f} GB per GPU "
                   f"at data.max_length={cfg.data.max_length} (estimate, within {MEMORY_MARGIN:.0%} of measured "
                   f"peaks), more than the {usable:,.1f} GB plan.gpu_memory_gb={limit:g} leaves after that margin; "
                   f"about {max(fits, 0)} sequence(s) per micro-batch fit (raise training.grad_accum instead)")
    if plan.data is not None:
        n = plan.data.sequences
        held = min(64, n // 20) if t.num_heldout is None else min(t.num_heldout, max(n - 1, 0))
        G = t.batch_size * t.grad_accum * processes(cfg)
        if G > n - held:
            out.append(f"training.batch_size={t.batch_size}: a global batch of {G} sequences (x training.grad_accum="
                       f"{t.grad_accum} x {processes(cfg)} process(es)) exceeds the {n - held} training sequences "
                       f"({plan.data.source})")
    return out
