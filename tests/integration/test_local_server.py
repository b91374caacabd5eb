"""The local target server: a real subprocess on loopback, real HTTP, real dump files.

Hidden states and tokens are checked against an in-process Hugging Face model loaded with
from_pretrained, which shares no code with the server's shard-by-shard loader.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
import torch

from eyas.dump import assemble, read_records
from eyas.local.engine import BAR_FORMAT, shard_files
from eyas.server.readiness import READY_LINE
from tests.local_reference import SPEC_FLAGS, greedy_reference, prompt, reference_model

CAPTURE = [2, 4, 6]
CHUNK = 16


@pytest.fixture(scope="module")
def server(start_server):
    proc = start_server(
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm",
        "EAGLE3",
        "--return-aux-hidden-state-layer-ids",
        *map(str, CAPTURE),
        "--chunked-prefill-size",
        str(CHUNK),
        "--disable-radix-cache",
        "--mem-fraction-static",
        "0.8",
        "--trust-remote-code",
        "--tp-size",
        "1",
        dump=True,
        name="local-server",
    )
    proc.wait_for(READY_LINE)
    return proc


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def reference(random_target):
    return reference_model(random_target)


# --- the log ---------------------------------------------------------------------------------


def test_log_has_sglang_lines_in_order(server, random_target):
    text = server.log_text()
    num_shards = len(shard_files(random_target))
    assert num_shards >= 8
    begin = text.index("Load weight begin. avail mem=")
    bar = text.index(
        f"\rMulti-thread loading shards:   0% Completed | 0/{num_shards} [00:00<?, ?it/s]\r"
    )
    end = text.index("Load weight end. elapsed=")
    warmup = text.index('"POST /generate HTTP/1.1" 200 OK')
    ready = text.index(READY_LINE)
    assert begin < bar < end < warmup < ready
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] The server is fired up", text, re.M)
    # every update is "\r<bar>", the last one is N/N and ends with the newline tqdm adds on close
    updates = re.findall(r"\r(Multi-thread loading shards:[^\r\n]*)", text)
    assert len(updates) >= num_shards + 1
    full = re.compile(
        r"Multi-thread loading shards: +(\d+)% Completed \| (\d+)/(\d+) "
        r"\[\d\d:\d\d<(\d\d:\d\d|\?), +([\d.]+(it/s|s/it)|\?it/s)\]"
    )
    assert all(full.fullmatch(u.rstrip()) for u in updates), updates
    assert re.search(rf"\| {num_shards}/{num_shards} \[[^\]]*\]\s*\n", text)
    assert "{" not in BAR_FORMAT.format(
        desc="d",
        percentage=1,
        n_fmt=1,
        total_fmt=2,
        elapsed="00:00",
        remaining="?",
        rate_fmt="?it/s",
    )


# --- status endpoints ------------------------------------------------------------------------


def test_status_endpoints(client, server, random_target):
    for path in ("/health", "/health_generate", "/ready"):
        assert client.get(path).status_code == 200, path
    info = client.get("/model_info").json()
    assert info["model_path"] == str(random_target) and info["is_generation"] is True
    assert info["architectures"] == ["DeepseekV3ForCausalLM"] and info["served_model_name"]
    srv = client.get("/server_info").json()
    assert srv["backend"] == "eyas-local" and srv["version"]
    assert srv["chunked_prefill_size"] == CHUNK and srv["aux_hidden_state_layer_ids"] == CAPTURE
    assert srv["port"] == server.port and srv["dump_dir"] == str(server.dump_dir)
    assert client.get("/nope").status_code == 404


def test_health_checks_and_warmup_write_no_dump(client, server):
    for _ in range(3):
        assert client.get("/health").status_code == 200
    names = [p.name for p in server.dump_dir.iterdir()] if server.dump_dir.exists() else []
    assert not [n for n in names if n.startswith(("HEALTH_CHECK", "WARMUP"))], names


# --- generation ------------------------------------------------------------------------------


def test_greedy_decode_equals_full_sequence_argmax(client, reference):
    ids = prompt(37, seed=1)  # 3 prefill chunks of 16
    r = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "rid": "greedy-1",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = greedy_reference(reference, ids, 12)
    assert body["output_ids"] == expected
    meta = body["meta_info"]
    assert meta["id"] == "greedy-1" and meta["prompt_tokens"] == 37 and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == len(expected) and meta["e2e_latency"] > 0
    assert meta["finish_reason"]["type"] == ("stop" if expected[-1] == 1 else "length")
    assert body["text"] == " ".join(f"w{t}" for t in expected if t > 2)


def test_chunked_prefill_dump_equals_one_forward(client, server, reference):
    ids = prompt(40, seed=2)
    r = client.post(
        "/generate",
        json={"input_ids": ids, "rid": "dump-1", "sampling_params": {"max_new_tokens": 0}},
    )
    assert r.status_code == 200, r.text
    assert (
        r.json()["output_ids"] == [] and r.json()["meta_info"]["finish_reason"]["type"] == "length"
    )
    records = read_records(server.dump_dir, "dump-1")  # written before the response was sent
    assert [rec.prefix_offset for rec in records] == [0, 16, 32]
    sample = assemble(records, ids)
    with torch.no_grad():
        hs = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in CAPTURE], dim=-1)
    assert sample.aux_hidden_states.shape == (40, 3 * 64)
    torch.testing.assert_close(sample.aux_hidden_states, aux, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sample.last_hidden_state, hs[-1][0], rtol=1e-4, atol=1e-5)
    assert (
        sample.meta["layer_ids"] == CAPTURE and sample.meta["layer_convention"] == "capture-before"
    )
    assert sample.meta["last_hidden_norm"] == "post"


def test_batch_input_and_text(client, server):
    a, b = prompt(5, seed=3), prompt(20, seed=4)
    r = client.post(
        "/generate",
        json={
            "input_ids": [a, b],
            "rid": ["batch-a", "batch-b"],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == ["batch-a", "batch-b"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [5, 20]
    assert len(read_records(server.dump_dir, "batch-b")) == 2
    r = client.post(
        "/generate", json={"text": "w5 w6 w7", "sampling_params": {"max_new_tokens": 1}}
    )
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 3


def test_sampling_is_seedable(client):
    def sample(seed):
        r = client.post(
            "/generate",
            json={
                "input_ids": prompt(6, seed=5),
                "sampling_params": {
                    "max_new_tokens": 8,
                    "temperature": 1.5,
                    "sampling_seed": seed,
                    "ignore_eos": True,
                },
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert sample(7) == sample(7)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {"input_ids": [1, 2, 600]},
            r"input_ids\[2\] = 600 is outside the vocabulary \(0\.\.511\)",
        ),
        ({"input_ids": [[1], [2, -1]], "rid": ["x", "y"]}, r"input_ids\[1\]\[1\] = -1"),
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature must be"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0.5}}, r"top_p=0\.5 is not supported"),
        (
            {"input_ids": [1], "sampling_params": {"max_tokens": 3}},
            r"unknown fields \['max_tokens'\]",
        ),
        ({"input_ids": [1], "rid": "../etc"}, "rid: invalid rid"),
        ({"input_ids": [[1], [2]], "rid": "one"}, "rid must be a list"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid has duplicates"),
        (
            {"input_ids": [1], "return_hidden_states": True},
            "return_hidden_states=True is not supported",
        ),
        ({"input_ids": [1], "text": "w5"}, "exactly one of input_ids and text"),
        ({"input_ids": [1], "prompt": "x"}, r"unknown fields \['prompt'\]"),
    ],
)
def test_bad_requests_get_400_naming_the_field(client, body, field):
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert re.search(field, r.json()["error"]), r.json()


def test_invalid_json_gets_400(client):
    r = client.post("/generate", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


# --- issue 16 (7): rids become folder names; Content-Length is checked before the body is read ---


def test_a_long_rid_gets_400_naming_the_limit(client, server):
    params = {"max_new_tokens": 1, "temperature": 0}
    r = client.post(
        "/generate", json={"input_ids": [5, 6, 7], "rid": "r" * 300, "sampling_params": params}
    )
    assert r.status_code == 400, (
        r.text
    )  # was a 500: the dump folder's name is too long for the filesystem
    assert re.search(
        r"rid: invalid rid 'r{40}'\.\.\.: 300 characters, at most "
        r"200",
        r.json()["error"],
    )
    longest = "k" * 200  # the limit itself is a folder name the dump can make
    r = client.post(
        "/generate", json={"input_ids": [5, 6, 7], "rid": longest, "sampling_params": params}
    )
    assert r.status_code == 200, r.text
    assert [p.name for p in (server.dump_dir / longest).iterdir()] == ["0000000000.safetensors"]


@pytest.mark.parametrize(
    "rid", ["a/b", "a\x00b", "..", "a..b", "", " x", "\u00e9t\u00e9", "a\\b", 7, ["x"]]
)
def test_rids_unsafe_as_a_folder_name_get_400(client, rid):
    r = client.post(
        "/generate", json={"input_ids": [[5], [6]], "rid": [rid, "ok"]}
    )  # ["x"]: was a 500
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("rid: invalid rid"), r.json()


def _raw_request(server, head: str) -> tuple[str, str]:
    """Send a request's head only and read until the server closes: (status line, body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(head.encode())
        data = b""
        while chunk := s.recv(65536):  # socket.timeout (a failure) if the server waits for a body
            data += chunk
    head_out, _, body = data.decode().partition("\r\n\r\n")
    assert "Connection: close" in head_out, head_out  # the rest of the stream cannot be framed
    return head_out.split("\r\n")[0], body


@pytest.mark.parametrize(
    "header, status, needle",
    [
        ("Content-Length: -1", 400, "Content-Length '-1' is not a byte count"),
        ("Content-Length: abc", 400, "Content-Length 'abc' is not a byte count"),
        ("Content-Length: 1_0", 400, "Content-Length '1_0' is not a byte count"),
        ("Content-Length: 5\r\nContent-Length: 6", 400, "conflicting Content-Length headers"),
        (f"Content-Length: {2**40}", 413, "at most 67108864 bytes"),
        ("Content-Length: " + "9" * 5000, 413, "at most 67108864 bytes"),
        ("Transfer-Encoding: chunked", 411, "send the body with a Content-Length"),
    ],
)
def test_a_bad_content_length_is_answered_at_once(client, server, header, status, needle):
    line, body = _raw_request(server, f"POST /generate HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n")
    assert line.startswith(f"HTTP/1.1 {status} "), line
    assert needle in json.loads(body)["error"]
    r = client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text  # and the server serves on


# ---------------------------------------------------------------------------------------------
# Speculative decoding with an exported EAGLE-3 drafter
# ---------------------------------------------------------------------------------------------


def test_speculative_server_matches_plain_greedy_and_reports_verify_steps(
    start_server, exported_drafter
):
    from transformers import AutoModelForCausalLM

    from eyas.evaluation.evaluate import target_greedy

    target, drafter = exported_drafter
    proc = start_server(
        *SPEC_FLAGS,
        "--speculative-draft-model-path",
        str(drafter),
        "--disable-radix-cache",
        model=target,
        name="spec-server",
    )
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    text = proc.wait_for(READY_LINE)
    assert "Loaded EAGLE3 draft model" in text
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 12, 30)]
    completion = verify = 0
    with httpx.Client(base_url=proc.url, timeout=60) as c:
        for ids in prompts:
            body = {
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
            }
            meta_before = c.get("/server_info").json()["internal_states"][0]
            res = c.post("/generate", json=body).json()
            with torch.no_grad():
                assert res["output_ids"] == target_greedy(reference, ids, 16, set())
            m = res["meta_info"]
            assert m["completion_tokens"] == 16 and m["finish_reason"]["type"] == "length"
            assert 15 / 4 <= m["spec_verify_ct"] <= 15  # 1..4 tokens per verify after the prefill's
            completion, verify = completion + 16, verify + m["spec_verify_ct"]
            after = c.get("/server_info").json()["internal_states"][0]
            assert after["spec_verify_ct"] - meta_before["spec_verify_ct"] == m["spec_verify_ct"]
        # sampled requests decode plainly (one verify per token after the first) and still work
        res = c.post(
            "/generate",
            json={
                "input_ids": prompts[0],
                "sampling_params": {
                    "temperature": 1.0,
                    "max_new_tokens": 5,
                    "ignore_eos": True,
                    "sampling_seed": 1,
                },
            },
        ).json()
        assert res["meta_info"]["spec_verify_ct"] == 4
        info = c.get("/server_info").json()
    assert info["speculative_draft_model_path"] == str(drafter)
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
    assert completion / verify >= 1.0
