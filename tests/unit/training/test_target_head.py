import json

import pytest
import safetensors
import torch
import transformers

import eyas.training.target_head as th
from eyas.training.target_head import TargetHead, load_target_tensors

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(random_target):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(random_target), dtype=torch.float32
    ).eval()


def test_reads_only_the_files_holding_the_three_tensors(random_target, model, monkeypatch):
    opened = []
    real = safetensors.safe_open

    def recording(path, *a, **kw):
        opened.append(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(th, "safe_open", recording)
    t = load_target_tensors(random_target, ["embed", "lm_head", "norm"])
    wmap = json.loads((random_target / "model.safetensors.index.json").read_text())["weight_map"]
    want = {wmap[n] for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    assert {p.split("/")[-1] for p in opened} == want
    assert len(set(wmap.values())) > len(want)  # there were other files to leave alone
    torch.testing.assert_close(t["embed"], model.model.embed_tokens.weight)
    torch.testing.assert_close(t["lm_head"], model.lm_head.weight)
    torch.testing.assert_close(t["norm"], model.model.norm.weight)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_logits_match_the_target(random_target, model, norm):
    ids = torch.randint(0, 512, (2, 11))
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: seen.update(pre=i[0], post=o))
    with torch.no_grad():
        want = model(ids).logits
    hook.remove()
    head = TargetHead.from_checkpoint(random_target, last_hidden_norm=norm)
    torch.testing.assert_close(head(seen[norm]), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(seen[norm].bfloat16()), want, atol=0.05, rtol=0.05)


def test_single_file_checkpoint_and_missing_tensor(tmp_path, model):
    model.save_pretrained(tmp_path)  # one model.safetensors, no index
    assert not (tmp_path / "model.safetensors.index.json").exists()
    t = load_target_tensors(tmp_path, ["lm_head"])
    torch.testing.assert_close(t["lm_head"], model.lm_head.weight)
    with pytest.raises(ValueError, match="neither"):
        load_target_tensors(tmp_path / "nope", ["lm_head"])
    with pytest.raises(ValueError, match="'pre' or 'post'"):
        TargetHead.from_checkpoint(tmp_path, last_hidden_norm="none")
