"""The tiny DeepSeek-V3 target: eyas's embedded default model, and how it is built, trained and
assembled.

SGLang cannot run on a 2-core laptop, so the pipeline's default target is a DeepSeek-V3-architecture
model small enough to serve there (8 layers, MLA attention, MoE with a shared expert, about 9.6M
parameters), trained on the Python standard library so that its hidden states carry real structure.

    python scripts/build_tiny_target.py fixtures/tiny-target --steps 3000 --device cuda
    # the same, from Python
    build_tiny_target(Path("fixtures/tiny-target"), steps=3000, device="cuda")

Variant "cpu" (fixtures/tiny-target-cpu, `--variant cpu`) is the same model at the widths real
SGLang's CPU kernels accept (CPU_VARIANT): 128 experts of 32, top-8, and larger heads, so about 26M
parameters.

The build has three stages, which may run on different machines (the committed fixture was made so:
the tokenizer here, the training on a lent GPU, the assembly here again):

    prepare_inputs(workdir)               stdlib *.py -> tokenizer.json, tokens.npz, inputs.json
                                          (eyas/local/tiny_corpus.py: corpus, tokenizer, chat
                                          template)
    train_from_inputs(workdir, state)     tokens -> trained weights (sharded safetensors), metrics
    assemble(workdir, state, out)         -> Hugging Face folder, accuracy measured on its weights

build_tiny_target() runs all three in one place.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eyas.errors import InvalidInput
from eyas.files import atomic_dir
from eyas.local.hf_folder import checkpoint_tensors, read_shards, write_shards
from eyas.local.tiny_corpus import (
    BOS,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS,
    EOS_ID,
    MIN_VOCAB,
    PAD,
    PAD_ID,
    STOP_TOKEN_IDS,
    prepare_inputs,
)
from eyas.training.optim import lr_factor, resolve_device

# --------------------------------------------------------------------------------------------------
# Architecture
# --------------------------------------------------------------------------------------------------


def tiny_config(vocab_size: int, variant: str = "default") -> DeepseekV3Config:
    """The tiny DeepSeek-V3 architecture: every structural feature of the real one, at toy widths.
    variant "cpu" (CPU_VARIANT) is the same model at widths real SGLang's CPU kernels serve."""
    if vocab_size < MIN_VOCAB:
        raise InvalidInput(f"vocab_size must be at least {MIN_VOCAB}, got {vocab_size}")
    if variant not in VARIANTS:
        raise InvalidInput(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    widths = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # the dense MLP of layer 0
        moe_intermediate_size=128,  # each routed expert, and the shared one
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        # MLA: queries and keys/values pass through low-rank latents; 16 of the 48 q/k dims carry
        # RoPE.
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        # MoE from layer 1 on: 8 routed experts, top-2 by sigmoid score, plus one shared expert.
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        num_nextn_predict_layers=0,  # no MTP module: eyas trains an EAGLE-3 drafter instead
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        # Read by SGLang's DeepSeek model code (unguarded) but not by transformers'
        # DeepseekV3Config; the values a real DeepSeek-V3 config has, and what transformers' routing
        # computes: sigmoid scores with the e_score_correction_bias in the choice, every layer from
        # first_k_dense_replace on MoE (tests/unit/test_fixtures_sglang.py scans the wheel for such
        # reads).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
    )
    return DeepseekV3Config(**{**widths, **VARIANTS[variant]})


#: The "cpu" variant: the widths SGLang's CPU kernels accept (the intel_amx attention backend, the
#: fused MoE and its top-k router, the rope), with the default's structure otherwise.
CPU_VARIANT = dict(
    # Attention head sizes must be multiples of 32: q/k 32 + 32 (RoPE), v 32, and the compressed KV
    # cache row that MLA decodes against, kv_lora_rank + qk_rope_head_dim = 96.
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    kv_lora_rank=64,
    # The top-k kernel routes top-8 over 128, 192, 256 or 384 experts; the fused expert kernel takes
    # intermediate sizes in blocks of 32, so 32 is the smallest expert.
    n_routed_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=32,
    # The CPU rope implements only DeepSeek's YaRN, and SGLang requires rope_scaling; YaRN with
    # factor 1.0 (original_max_position_embeddings equal to max_position_embeddings) is plain RoPE.
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 1.0,
        "original_max_position_embeddings": 1024,
    },
)
VARIANTS = {"default": {}, "cpu": CPU_VARIANT}


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainSettings:
    steps: int
    batch_size: int = 32  # sequences per step
    seq_len: int = 512  # tokens per sequence; the pipeline's conversations are at most ~400
    lr: float = 2e-3  # peak; a ~10M-parameter model takes a high rate
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1  # the corpus is ~4M tokens, so training sees it several times
    grad_clip: float = 1.0
    eval_every: int = 250  # steps between validation passes; the best one is kept
    balance_rate: float = 1e-3  # DeepSeek-V3's aux-loss-free router bias step (its gamma)
    #: Stop early, keeping the best validated state, once training has run this long: a lent GPU's
    #: command is killed at its time limit, and a killed run returns nothing.
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise InvalidInput(
                f"bad schedule: lr={self.lr} min_lr_ratio={self.min_lr_ratio} "
                f"warmup={self.warmup_steps}"
            )


def _autocast(device: str | torch.device):
    # bf16 on the GPU as SGLang would serve it; plain fp32 on CPU, where bf16 matmuls are slow.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda")


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]


def _count_routes(model: torch.nn.Module) -> dict[torch.nn.Module, torch.Tensor]:
    """Hook every router to count, while training, how many tokens each expert receives."""
    loads = {}
    for router in _routers(model):
        loads[router] = torch.zeros(router.num_experts, device=router.weight.device)

        def hook(module, _inputs, outputs):
            if (
                module.training
            ):  # the router returns (logits, weights, indices); only indices are ints
                indices = next(t for t in outputs if not t.is_floating_point())
                loads[module] += torch.bincount(indices.flatten(), minlength=module.num_experts)

        router.register_forward_hook(hook)
    return loads


@torch.no_grad()
def _rebalance(loads: dict[torch.nn.Module, torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower
    the bias of over-loaded ones. The bias only steers which experts are chosen, not their
    weights."""
    for router, load in loads.items():
        router.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForCausalLM,
    ids: np.ndarray,
    seq_len: int,
    device: str | torch.device,
    batch_size: int = 16,
) -> dict:
    """Mean loss and greedy next-token accuracy over `ids`, cut into windows of seq_len + 1
    tokens."""
    if ids.size < 2:
        raise InvalidInput("evaluate needs at least 2 tokens")
    was_training = model.training
    model.eval()
    tokens = torch.from_numpy(ids.astype(np.int64))
    # Windows start every seq_len tokens, so each token is predicted once; the full ones are batched
    # and the shorter tail, if any, goes alone.
    full = list(range(0, ids.size - seq_len, seq_len))
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    tail = full[-1] + seq_len if full else 0
    if ids.size - tail >= 2:
        groups.append([tail])
    total_loss, num_correct, num_tokens = 0.0, 0, 0
    for group in groups:
        length = min(seq_len + 1, ids.size - group[0])
        window = torch.stack([tokens[s : s + length] for s in group]).to(device)  # (B, T+1)
        with _autocast(device):
            logits = model(input_ids=window[:, :-1]).logits.float()  # (B, T, V)
        targets = window[:, 1:]  # (B, T)
        total_loss += F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum"
        ).item()
        num_correct += (logits.argmax(-1) == targets).sum().item()
        num_tokens += targets.numel()
    model.train(was_training)
    return {
        "loss": total_loss / num_tokens,
        "accuracy": num_correct / num_tokens,
        "num_tokens": num_tokens,
    }


def baselines(train_ids: np.ndarray, test_ids: np.ndarray, vocab_size: int) -> dict:
    """What a model with no context (unigram) or one token of context (bigram) scores on
    `test_ids`."""
    targets, previous = test_ids[1:].astype(np.int64), test_ids[:-1].astype(np.int64)
    counts = np.bincount(train_ids, minlength=vocab_size)
    probs = (counts + 1) / (
        counts.sum() + vocab_size
    )  # add-one, so unseen tokens have a finite loss
    pairs = train_ids[:-1].astype(np.int64) * vocab_size + train_ids[1:]
    bigram = (
        np.bincount(pairs, minlength=vocab_size * vocab_size)
        .reshape(vocab_size, vocab_size)
        .argmax(1)
    )
    return {
        "unigram_accuracy": float(np.mean(targets == counts.argmax())),
        "unigram_loss": float(-np.mean(np.log(probs[targets]))),
        "bigram_accuracy": float(np.mean(bigram[previous] == targets)),
    }


def _pick_experts_implementation(
    model: DeepseekV3ForCausalLM, x: torch.Tensor, device: torch.device, log: Callable
) -> None:
    """Keep transformers' default grouped_mm experts unless it fails here: a GPU machine may run an
    older transformers than this project pins (the fixture was trained under 5.17), and grouped_mm
    depends on the torch build."""
    try:
        with _autocast(device):
            model(input_ids=x).logits.float().mean().backward()
    except (RuntimeError, NotImplementedError) as error:
        log(f"grouped_mm experts failed ({error}); falling back to eager experts")
        model.set_experts_implementation("eager")
    model.zero_grad(set_to_none=True)


def _optimizer(model, s: TrainSettings, device: torch.device):
    """AdamW with weight decay on matrices and expert stacks (not norms), and its warm-up-cosine
    schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": keep, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, s.warmup_steps, s.steps, s.min_lr_ratio)
    )
    return optimizer, schedule


def _window_sampler(
    train_ids: np.ndarray, s: TrainSettings, device: torch.device, seed: int
) -> Callable[[], torch.Tensor]:
    """batch(): batch_size random windows of seq_len + 1 tokens of train_ids, from a generator of
    its own."""
    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    generator = torch.Generator(device).manual_seed(seed)
    offsets = torch.arange(s.seq_len + 1, device=device)

    def batch() -> torch.Tensor:
        starts = torch.randint(
            0, data.numel() - s.seq_len - 1, (s.batch_size, 1), device=device, generator=generator
        )
        return data[starts + offsets]  # (B, T+1)

    return batch


def _step(
    model, window: torch.Tensor, optimizer, schedule, s: TrainSettings, device: torch.device
) -> torch.Tensor:
    """One optimizer step on a (B, T+1) window -> its loss."""
    with _autocast(device):
        logits = model(input_ids=window[:, :-1]).logits  # (B, T, V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    optimizer.step()
    schedule.step()
    return loss


def _validation_row(
    model, val_ids: np.ndarray, s: TrainSettings, device, step: int, loss: torch.Tensor, log
) -> dict:
    """The history's row for this step: its training loss and the validation figures."""
    val = evaluate(model, val_ids, s.seq_len, device)
    row = {
        "step": step,
        "train_loss": loss.item(),
        "val_loss": val["loss"],
        "val_accuracy": val["accuracy"],
    }
    log(f"step {step} val loss {val['loss']:.4f} val accuracy {val['accuracy']:.4f}")
    return row


def train_model(
    config: DeepseekV3Config,
    train_ids: np.ndarray,
    val_ids: np.ndarray,
    settings: TrainSettings,
    *,
    device: str | torch.device = "auto",
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[DeepseekV3ForCausalLM, dict]:
    """Train a fresh model on random windows of `train_ids`; return the one with the best validation
    loss (checked every eval_every steps) and the training history."""
    device, s = resolve_device(device), settings
    if train_ids.size <= s.seq_len + 1:
        raise InvalidInput(
            f"train_ids has {train_ids.size} tokens, fewer than one window of {s.seq_len + 1}"
        )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(device).train()
    batch = _window_sampler(train_ids, s, device, seed)
    _pick_experts_implementation(model, batch()[:2, :-1], device, log)
    optimizer, schedule = _optimizer(model, s, device)
    loads = _count_routes(model)
    history, best, started = [], None, time.monotonic()
    for step in range(1, s.steps + 1):
        loss = _step(model, batch(), optimizer, schedule, s, device)
        _rebalance(loads, s.balance_rate)
        elapsed = time.monotonic() - started
        out_of_time = s.max_seconds is not None and elapsed > s.max_seconds
        if step % 100 == 0 or step == 10:
            log(
                f"step {step}/{s.steps} loss {loss.item():.4f} lr {schedule.get_last_lr()[0]:.2e} "
                f"{elapsed:.0f}s"
            )
        if step % s.eval_every == 0 or step == s.steps or out_of_time:
            history.append(_validation_row(model, val_ids, s, device, step, loss, log))
            if best is None or history[-1]["val_loss"] < best["val_loss"]:
                best = {
                    **history[-1],
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                }
        if out_of_time:
            log(f"stopping at step {step}: past max_seconds={s.max_seconds}")
            break
    model.load_state_dict(best.pop("state"))
    run = {
        "steps_done": step,
        "train_seconds": time.monotonic() - started,
        "best": best,
        "history": history,
    }
    return model, run


def train_from_inputs(
    workdir: Path,
    state_dir: Path,
    *,
    steps: int,
    device: str = "auto",
    seed: int = 0,
    variant: str = "default",
    **settings,
) -> dict:
    """Train on the token streams prepare_inputs wrote; write the weights (sharded, bf16) and
    metrics."""
    workdir, device = Path(workdir), resolve_device(device)
    info = json.loads((workdir / "inputs.json").read_text())
    tokens = np.load(workdir / "tokens.npz")
    s = TrainSettings(steps=steps, **settings)
    config = tiny_config(info["vocab_size"], variant)
    model, run = train_model(config, tokens["train"], tokens["val"], s, device=device, seed=seed)
    test = evaluate(model, tokens["test"], s.seq_len, device)
    metrics = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "variant": variant,
        "settings": asdict(s),
        "seed": seed,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "test_loss": test["loss"],
        "test_accuracy": test["accuracy"],
        "test_tokens": test["num_tokens"],
        **run,
    }
    print(f"test loss {test['loss']:.4f} test accuracy {test['accuracy']:.4f}")
    state = {
        k: v if "e_score_correction_bias" in k else v.to(torch.bfloat16)
        for k, v in model.state_dict().items()
    }
    # Files of about 10 MiB (at least two), so that each, one tensor over, stays under the 16 MiB a
    # file that a lent GPU's command may return.
    num_shards = max(
        2, math.ceil(sum(v.numel() * v.element_size() for v in state.values()) / (10 << 20))
    )
    with atomic_dir(Path(state_dir)) as tmp:
        write_shards(state, tmp, num_shards=num_shards, prefix="state")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def hf_config_dict(config: DeepseekV3Config, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json's content for a model of this config stored in dtype (what save_hf_folder
    writes)."""
    config = copy.deepcopy(config)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.dtype = dtype
    config_dict = json.loads(config.to_json_string(use_diff=False))
    config_dict["rope_theta"] = config.rope_parameters[
        "rope_theta"
    ]  # for readers of the older layout
    return config_dict


def save_hf_folder(
    model: DeepseekV3ForCausalLM,
    tokenizer: Tokenizer,
    out: Path,
    num_shards: int = 8,
    *,
    dtype: torch.dtype = torch.bfloat16,
    build_info: dict | None = None,
) -> None:
    """Write a Hugging Face folder that transformers' Auto classes load: config.json, num_shards
    safetensors shards with their index, tokenizer.json, tokenizer_config.json (with the chat
    template) and generation_config.json; build_info, when given, goes to eyas_build.json.
    Atomic."""
    config_dict = hf_config_dict(model.config, dtype)
    config = model.config
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,  # the chat template writes <|bos|> itself
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {
        "bos_token_id": BOS_ID,
        "eos_token_id": list(STOP_TOKEN_IDS),
        "pad_token_id": PAD_ID,
        "do_sample": False,
    }
    with atomic_dir(Path(out)) as tmp:
        write_shards(checkpoint_tensors(model, dtype), tmp, num_shards)
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, content in [
            ("config.json", config_dict),
            ("tokenizer_config.json", tokenizer_config),
            ("generation_config.json", generation_config),
            ("eyas_build.json", build_info),
        ]:
            if content is not None:
                (tmp / name).write_text(json.dumps(content, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# The whole build
# --------------------------------------------------------------------------------------------------


def assemble(
    workdir: Path, state_dir: Path, out: Path, *, num_shards: int = 8, variant: str = "default"
) -> dict:
    """Load the trained weights into a model, re-measure it here, and write the Hugging Face
    folder."""
    workdir, state_dir = Path(workdir), Path(state_dir)
    info = json.loads((workdir / "inputs.json").read_text())
    trained = json.loads((state_dir / "metrics.json").read_text())
    if trained.get("variant", "default") != variant:
        raise InvalidInput(f"{state_dir} holds a {trained['variant']!r} model, not {variant!r}")
    tokens = np.load(workdir / "tokens.npz")
    tokenizer = Tokenizer.from_file(str(workdir / "tokenizer.json"))
    model = DeepseekV3ForCausalLM(tiny_config(tokenizer.get_vocab_size(), variant))
    model.load_state_dict(
        {k: v.float() for k, v in read_shards(state_dir, "state").items()}, strict=True
    )
    # Measured again here, in fp32 on the bf16 weights that ship: what the local server will serve.
    test = evaluate(model.eval(), tokens["test"], trained["settings"]["seq_len"], "cpu")
    metrics = {
        "inputs": {k: v for k, v in info.items() if k not in ("test_files", "val_files")},
        "test_files": info["test_files"],
        "training": trained,
        "fixture_test_loss": test["loss"],
        "fixture_test_accuracy": test["accuracy"],
        **baselines(tokens["train"], tokens["test"], info["vocab_size"]),
    }
    save_hf_folder(model, tokenizer, Path(out), num_shards, build_info=metrics)
    return metrics


def build_tiny_target(
    out: Path,
    *,
    steps: int,
    device: str = "auto",
    seed: int = 0,
    vocab_size: int = 4096,
    variant: str = "default",
    **settings,
) -> dict:
    """Build the whole fixture in one place: corpus, tokenizer, training, Hugging Face folder at
    `out`."""
    with tempfile.TemporaryDirectory(prefix="eyas-tiny-target-") as tmp:
        prepare_inputs(Path(tmp) / "inputs", vocab_size=vocab_size, seed=seed)
        train_from_inputs(
            Path(tmp) / "inputs",
            Path(tmp) / "state",
            steps=steps,
            device=device,
            seed=seed,
            variant=variant,
            **settings,
        )
        return assemble(Path(tmp) / "inputs", Path(tmp) / "state", Path(out), variant=variant)
