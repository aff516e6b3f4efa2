"""The ``kvpage`` command end to end: plan on the embedded model, presets, files; trace and its PNG."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvpage.entrypoints.cli import main
from kvpage.model.config import config_from_gguf
from kvpage.model.registry import default_model_path, load_model_config
from kvpage.sim.trace import BUILTIN_SCENARIO, TraceRunner


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------- models
def test_default_model_is_read_from_the_installed_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = load_model_config()
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.architecture == "llama" and cfg.max_position_embeddings == 8192
    assert cfg.extra["file_type"] == "Q4_1" and cfg.tie_word_embeddings


def test_hf_directory_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "hidden_size": 3584, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    }))
    cfg = load_model_config(str(tmp_path))
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.architecture) == (28, 4, 128, "qwen2")
    assert cfg.attention_bias


def test_bad_model_inputs_are_named(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model_config(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        config_from_gguf(bad)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_model_config(str(tmp_path / "d"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError, match="unsupported model file"):
        load_model_config(str(other))


def test_gguf_written_by_the_gguf_package(tmp_path: Path):
    """A GGUF we write ourselves (Mistral-like GQA) is read back field for field."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(4)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_embedding_length(256)
    w.add_context_length(4096)
    w.add_feed_forward_length(512)
    w.add_rope_freq_base(1e6)
    w.add_tensor("token_embd.weight", np.zeros((16, 256), dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((16, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = config_from_gguf(path)
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 8, 2, 32)
    assert cfg.rope_theta == 1e6 and not cfg.tie_word_embeddings


# --------------------------------------------------------------------- plan
def test_plan_default_model(capsys):
    code, out, _ = run(capsys, "plan", "--kv-memory", "1GiB")
    assert code == 0
    assert "SmolLM2-135M-Instruct" in out and "22.5 KiB" in out and "2,912 blocks" in out


def test_plan_and_simulate_take_the_servers_flag_names(capsys):
    """--kv-cache-memory / --kv-cache-dtype, as serve and generate spell them, mean the same to plan and simulate."""
    a = run(capsys, "plan", "--kv-memory", "1GiB", "--dtype", "int8", "--json")
    b = run(capsys, "plan", "--kv-cache-memory", "1GiB", "--kv-cache-dtype", "int8", "--json")
    assert a[0] == b[0] == 0 and json.loads(a[1]) == json.loads(b[1])
    sim = ["simulate", "--num-requests", "8", "--json"]
    a = run(capsys, *sim, "--kv-memory", "64MiB")
    b = run(capsys, *sim, "--kv-cache-memory", "64MiB")
    assert a[0] == b[0] == 0 and json.loads(a[1]) == json.loads(b[1])


def test_plan_seed_example_json(capsys):
    code, out, _ = run(capsys, "plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp16",
                       "--context-len", "8192", "--tensor-parallel-size", "2", "--kv-memory", "8GiB",
                       "--tail-waste", "0.04", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["bytes_per_token"] == 320 * 1024
    assert d["paged_max_requests_tail_estimate"] == 6 and d["kv_heads_per_rank"] == 4


def test_plan_preset_override_and_replication(capsys):
    code, out, _ = run(capsys, "plan", "--model", "Llama-3-70B", "--kv-heads", "64", "--context-len", "4096",
                       "-tp", "3", "--kv-memory", "80GiB")
    assert code == 0
    assert "2.5 MiB per rank" in out and "replicated" in out and "10 GiB per rank" in out
    code, out, _ = run(capsys, "plan", "--model", "mha-96l", "--context-len", "2048", "--kv-memory", "64GiB")
    assert code == 0 and "4.5 MiB" in out and "9 GiB" in out


def test_plan_list_presets(capsys):
    code, out, _ = run(capsys, "plan", "--list-presets")
    assert code == 0
    for name in ("Llama-3-8B", "Llama-3-70B", "Mistral-7B", "Qwen2.5-7B", "GPT-3-175B"):
        assert name in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--kv-memory", "lots"], "cannot read size 'lots'"),
        (["plan", "--kv-memory", "8"], "did you forget a unit"),
        (["plan", "--model", "no-such-model"], "model 'no-such-model' not found"),
        (["plan", "--layers", "4"], "needs all of --layers, --kv-heads and --head-dim"),
        (["plan", "--dtype", "int3"], "unknown KV dtype 'int3'"),
        (["plan", "--context-len", "9000"], "exceeds max_model_len=8192"),
        (["trace", "--scenario", "/no/such/file.yaml"], "scenario file not found"),
    ],
)
def test_cli_errors_exit_nonzero_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and not out


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "kvpage.entrypoints.cli", "plan", "--kv-memory", "512MiB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "max_model_len" in r.stdout


# -------------------------------------------------------------------- trace
def test_builtin_trace_shows_every_behaviour(capsys, tmp_path: Path):
    png = tmp_path / "pool.png"
    code, out, _ = run(capsys, "trace", "--png", str(png))
    assert code == 0
    assert "A tokens pos:(block,offset)  0:(0,0) 1:(0,1) 2:(0,2) 3:(0,3) 4:(1,0) 5:(1,1)" in out
    assert "8:(2,0)" in out  # token 8 opens a new block
    assert "copy-on-write, copy block 2 -> block 11" in out  # the blocks after A's are set aside for A
    assert "prefix-cache hit, 8 tokens in blocks [0, 1]" in out
    assert "D tokens pos:(block,offset)  0:(2,0)" in out  # D reuses A's freed block 2
    assert "copy device->host" in out and "copy host->device h2->11" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_trace_records_match_the_manager():
    records = TraceRunner(dict(BUILTIN_SCENARIO)).run()
    last = records[-1]
    assert last.stats.used_blocks == 0 and last.stats.cached_free_blocks > 0
    fork = records[2]
    assert fork.block_tables["A"] == fork.block_tables["B"]
    assert all(v.ref_count == 2 for v in fork.pool if v.owners)


def test_trace_from_yaml_and_json_files(capsys, tmp_path: Path):
    yml = tmp_path / "s.yaml"
    yml.write_text(
        "block_size: 2\nnum_blocks: 6\nsteps:\n"
        "  - arrive: X\n    prompt: 'hello'\n    chunk: 3\n"
        "  - prefill: X\n"
        "  - decode: X\n    count: 2\n"
        "  - arrive: Y\n    prompt: 'hello'\n    cache_salt: other-tenant\n"
    )
    code, out, _ = run(capsys, "trace", "--scenario", str(yml))
    assert code == 0
    assert "X tokens pos:(block,offset)  0:(0,0) 1:(0,1) 2:(1,0)" in out
    assert "prefix-cache hit" not in out  # a different salt never shares
    js = tmp_path / "s.json"
    js.write_text(json.dumps({"block_size": 4, "num_blocks": 4, "policy": "static", "max_model_len": 8,
                              "steps": [{"arrive": "A", "prompt": [1, 2]}, {"arrive": "B", "prompt": [3]},
                                        {"arrive": "C", "prompt": [4]}]}))
    code, out, _ = run(capsys, "trace", "--scenario", str(js))
    assert code == 0 and "C: not admitted now" in out and "A=[0, 1]  B=[2, 3]" in out


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([{"explode": "A"}], "unknown operation 'explode'"),
        ([{"decode": "A"}], "no request named 'A'"),
        ([{"arrive": "A"}], "needs a non-empty 'prompt'"),
        ([{"arrive": "A", "prompt": [1]}, {"arrive": "A", "prompt": [1]}], "already exists"),
        ([{"arrive": "A", "prompt": [1]}, {"swap_in": "A"}], "not swapped out"),
    ],
)
def test_trace_scenario_errors(capsys, tmp_path: Path, steps, message):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"steps": steps}))
    code, _, err = run(capsys, "trace", "--scenario", str(f))
    assert code == 2 and message in err and "step" in err


def test_trace_rejects_unknown_settings(capsys, tmp_path: Path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"blocksize": 4, "steps": []}))
    code, _, err = run(capsys, "trace", "--scenario", str(f))
    assert code == 2 and "unknown scenario settings: blocksize" in err


def test_gguf_struct_sanity():
    # The embedded file starts with the GGUF magic and version 3.
    head = default_model_path().read_bytes()[:8]
    assert head[:4] == b"GGUF" and struct.unpack("<I", head[4:8])[0] == 3


def test_sliding_window_trace_shows_blocks_leaving(capsys):
    """The built-in sliding scenario: blocks are released as the window passes them, a hit needs only the
    window's blocks, and a sequence never holds more than ceil((W - 1) / block_size) + 1 of them."""
    code, out, _ = run(capsys, "trace", "--builtin", "sliding")
    assert code == 0 and "sliding window 6 positions" in out
    assert "the window passed block 0: released" in out
    assert "prefix-cache hit, 12 tokens in blocks [-1, 1, 2]" in out
    assert "A=[-, -, -, 3, 5]" in out
    runner = TraceRunner({**__import__("kvpage.sim.trace", fromlist=["x"]).SLIDING_SCENARIO})
    for rec in runner.run():
        for table in rec.block_tables.values():
            assert sum(1 for b in table if b >= 0) <= -(-(6 - 1) // 4) + 1


# ----------------------------------------------------------------- generate
def test_generate_renders_chats_with_a_given_template(capsys, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
    code, out, _ = run(capsys, "generate", "Name a color.", "--chat", "--chat-template", str(path), "--max-tokens",
                       "2", "--json", "--kv-cache-memory", "64MiB", "--max-model-len", "256")
    assert code == 0
    ids = json.loads(out)[0]["prompt_token_ids"]
    from kvpage.model.tokenizer import KVTokenizer

    text = KVTokenizer.from_gguf(default_model_path()).decode(ids, skip_special_tokens=False)
    assert text == "<user>Name a color.\n<assistant>"


@pytest.mark.parametrize(("argv", "message"), [
    (["--chat-template", "{{ x }}"], "applies to --chat prompts"),
    (["--chat", "--chat-template", "chatml"], "neither a file nor a Jinja template"),
    (["--chat", "--chat-template", "{% if %}"], "does not compile"),
])
def test_generate_refuses_a_bad_chat_template_by_name(capsys, argv, message):
    code, _, err = run(capsys, "generate", "hi", *argv)
    assert code == 2 and message in err
