"""GGUF models from a hub repo (`org/name-GGUF:TAG`), fetched shard-only with HTTP Range requests.

Unit tests: the tag picks the file as llama.cpp picks it, byte ranges merge and subtract, the header's end is
found in a prefix, a sparse file keeps its record. In one process against the loopback hub (tests/hub_server.py):
planning fetches headers only, a shard fetches only its tensors' ranges, a new plan only what it adds. Real
nodes: a three-node ring where each node fetched only header ranges and its own tensors (from the hub's request
log) and answers as transformers does loading the same file in float32; a split GGUF in a subfolder.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from huggingface_hub import constants

pytest.importorskip("gguf", reason="gguf is not installed")

from exo_like.errors import HubUnavailableError, ModelNotFoundError  # noqa: E402
from exo_like.models.checkpoint import local_tensor_name  # noqa: E402
from exo_like.models.config import ModelArgs  # noqa: E402
from exo_like.models.gguf.file import GGUFCheckpoint, open_gguf  # noqa: E402
from exo_like.models.gguf.header import header_end  # noqa: E402
from exo_like.models.gguf.select import available_tags, pick_gguf, split_tag  # noqa: E402
from exo_like.models.gguf.tokenizer import gguf_tokenizer  # noqa: E402
from exo_like.models.hub.download import ShardDownloader  # noqa: E402
from exo_like.models.hub.progress import DownloadProgress  # noqa: E402
from exo_like.models.hub.sparse_file import SparseFile, coalesce, subtract  # noqa: E402
from exo_like.models.names.name import parse_model_name  # noqa: E402
from exo_like.models.names.resolver import fetch_hub_model  # noqa: E402
from exo_like.models.shard import Shard  # noqa: E402
from tests.api_server import NodeProcess, start_node, stop_nodes, wait_for  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.cluster_harness import BY_MEMORY, cluster_of, start_cluster, wait_until_ready  # noqa: E402
from tests.gguf_checkpoints import write_gguf  # noqa: E402
from tests.hub_server import HubServer, Served  # noqa: E402
from tests.oracle import gguf_greedy  # noqa: E402

REPO, SPLIT, LLAMA3 = "test-org/tiny-GGUF", "test-org/tiny-split-GGUF", "test-org/tiny-llama3-GGUF"
N_LAYERS, MAX_TOKENS = 6, 12
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


# -- which file a tag picks ---------------------------------------------------------------------------------------


def test_a_tag_follows_the_repo_id_and_nothing_else_is_one() -> None:
    assert split_tag("org/name-GGUF:Q4_K_M") == ("org/name-GGUF", "Q4_K_M")
    assert split_tag("org/name-GGUF@v1:q8_0") == ("org/name-GGUF@v1", "Q8_0")
    assert split_tag("org/name-GGUF") == ("org/name-GGUF", None)
    assert split_tag("C:model") == ("C:model", None)  # no repo id before the colon


def test_the_tag_picks_files_as_llama_cpp_does() -> None:
    files = ["README.md", "x-Q8_0.gguf", "x-Q4_K_M.gguf", "x-q4_k_s.gguf", "mmproj-x-Q4_K_M.gguf", "x-F16.gguf",
             "BF16/x-BF16-00002-of-00002.gguf", "BF16/x-BF16-00001-of-00002.gguf"]
    assert pick_gguf(files, "q4_k_m", "org/x") == ["x-Q4_K_M.gguf"]  # case-insensitive; the projector is no model
    assert pick_gguf(files, "Q4_K_S", "org/x") == ["x-q4_k_s.gguf"]
    assert pick_gguf(files, "bf16", "org/x") == ["BF16/x-BF16-00001-of-00002.gguf", "BF16/x-BF16-00002-of-00002.gguf"]
    assert pick_gguf(files, None, "org/x") == ["x-Q4_K_M.gguf"]  # the default tag
    assert pick_gguf([f for f in files if "Q4_K_M" not in f], None, "org/x") == ["x-Q8_0.gguf"]  # then Q8_0
    assert pick_gguf(["b-F16.gguf", "a-F32.gguf"], None, "org/x") == ["a-F32.gguf"]  # then the first file
    assert available_tags(files) == ["BF16", "F16", "Q4_K_M", "Q4_K_S", "Q8_0"]


def test_a_tag_no_file_has_and_a_missing_part_are_named() -> None:
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file tagged 'Q5_K_M'.*F16, Q8_0"):
        pick_gguf(["x-Q8_0.gguf", "x-F16.gguf"], "Q5_K_M", "org/x")
    with pytest.raises(ModelNotFoundError, match="lacks some of its 3 parts"):
        pick_gguf(["x-Q8_0-00001-of-00003.gguf", "x-Q8_0-00003-of-00003.gguf"], "Q8_0", "org/x")
    with pytest.raises(ModelNotFoundError, match="holds no GGUF model"):
        pick_gguf(["README.md", "mmproj-F16.gguf"], None, "org/x")


# -- byte ranges, headers, sparse files --------------------------------------------------------------------------


def test_ranges_merge_across_small_gaps_and_subtract() -> None:
    assert coalesce([(10, 20), (0, 5), (20, 30), (33, 40), (60, 70)], max_gap=3) == [(0, 5), (10, 40), (60, 70)]
    assert coalesce([(0, 10), (2, 4), (5, 5)]) == [(0, 10)]
    assert subtract([(0, 100)], [(10, 20), (50, 120)]) == [(0, 10), (20, 50)]
    assert subtract([(0, 10), (20, 30)], [(0, 10)]) == [(20, 30)]
    assert subtract([(0, 10)], []) == [(0, 10)]


def test_the_header_end_is_found_in_a_prefix_and_not_before(gguf_repos: dict[str, Path]) -> None:
    path = gguf_repos[REPO] / "tiny-Q8_0.gguf"
    data = path.read_bytes()
    gguf = GGUFCheckpoint(path)
    first_tensor = min(entry.offset for entry in gguf.tensors.values())
    end = header_end(data, path.name)
    assert end == first_tensor  # the writer puts the first tensor right at the data start
    assert header_end(data[:end], path.name) == end
    assert header_end(data[:end - 40], path.name) is None and header_end(data[:100], path.name) is None


def test_a_sparse_file_keeps_its_record_and_drops_a_foreign_one(tmp_path: Path) -> None:
    sparse = SparseFile(tmp_path / "m.gguf", 1000)
    sparse.write(100, b"x" * 50)
    sparse.mark(100, 150)
    sparse.write(0, b"h" * 20)
    sparse.mark(0, 20, header=True)
    again = SparseFile(tmp_path / "m.gguf", 1000)
    assert (again.present, again.header_end) == ([(0, 20), (100, 150)], 20)
    assert again.missing([(10, 120), (140, 200)]) == [(20, 100), (150, 200)]
    data = (tmp_path / "m.gguf").read_bytes()
    assert len(data) == 1000 and data[100:150] == b"x" * 50 and data[150:] == bytes(850)
    resized = SparseFile(tmp_path / "m.gguf", 2000)  # another file now: nothing of it is trusted
    assert resized.present == [] and resized.header_end is None and (tmp_path / "m.gguf").stat().st_size == 2000


# -- in one process, against the loopback hub -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Rows of 256 and a few MB of Q8_0: the first header request (256 KB) covers a small part of the file.
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", "llama", n_layers=N_LAYERS, seed=1,
                           hidden_size=256, intermediate_size=512, rope_scaling=None)


@pytest.fixture(scope="module")
def gguf_repos(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    single = tmp_path_factory.mktemp("repo")
    write_gguf(hf_folder, single / "tiny-Q8_0.gguf", "Q8_0")
    write_gguf(hf_folder, single / "tiny-F16.gguf", "F16")
    (single / "README.md").write_text("GGUF files of a tiny random model")
    split = tmp_path_factory.mktemp("split-repo")
    (split / "Q8_0").mkdir()
    write_gguf(hf_folder, split / "Q8_0" / "tiny-Q8_0.gguf", "Q8_0", split_max_tensors=22)
    # Llama 3.1's rope scaling, which llama.cpp's converter writes as the tensor rope_freqs.weight, first in the file.
    llama3 = tmp_path_factory.mktemp("llama3-repo")
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    llama3_folder = make_checkpoint(tmp_path_factory.mktemp("hf") / "llama3", "llama", n_layers=N_LAYERS, seed=1,
                                    hidden_size=256, intermediate_size=512, rope_scaling=rope)
    write_gguf(llama3_folder, llama3 / "tiny-llama3-Q8_0.gguf", "Q8_0")
    return {REPO: single, SPLIT: split, LLAMA3: llama3}


@pytest.fixture(scope="module")
def hub(gguf_repos: dict[str, Path]) -> Iterator[HubServer]:
    server = HubServer()
    for repo_id, folder in gguf_repos.items():
        server.add_repo(repo_id, folder)
    server.start()
    yield server
    server.stop()


def cdn_ranges(requests: list[Served], name: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of every range of a file the CDN sent."""
    return sorted((r.range_start or 0, (r.range_start or 0) + r.bytes_sent) for r in requests
                  if r.path.startswith("/cdn/") and r.status in (200, 206) and (name is None or r.file == name))


def tensor_spans(path: Path, shard: Shard, tied: bool = False) -> dict[Path, list[tuple[int, int]]]:
    """Byte ranges of the shard's tensors in each part of the original file."""
    spans: dict[Path, list[tuple[int, int]]] = {}
    for name, entry in GGUFCheckpoint(path).tensors.items():
        if local_tensor_name(name, shard, tied) is not None:
            spans.setdefault(entry.part, []).append((entry.offset, entry.offset + entry.n_bytes))
    return spans


def test_planning_reads_headers_and_each_plan_fetches_only_what_it_adds(hub: HubServer, gguf_repos: dict[str, Path],
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    original = gguf_repos[REPO] / "tiny-Q8_0.gguf"
    data = original.read_bytes()
    end = header_end(data, original.name)
    seen = len(hub.requests())
    model = fetch_hub_model(parse_model_name(f"{REPO}:q8_0", tmp_path), tmp_path / "cache")
    assert (model.name, model.key) == (f"{REPO}:Q8_0", f"{REPO}@{hub.repos[REPO].commit}:Q8_0")
    assert model.folder.name == "tiny-Q8_0.gguf" and model.folder.stat().st_size == len(data)
    headers = cdn_ranges(hub.requests(since=seen))
    assert headers[0][0] == 0 and headers[-1][1] < len(data) // 4  # a prefix of the file, not the file
    assert model.args.num_hidden_layers == N_LAYERS and model.manifest.footprint.layer_bytes

    downloader = ShardDownloader(tmp_path / "cache", "n0", DownloadProgress())
    try:
        plans = [(Shard(REPO, 0, 2, N_LAYERS), range(0, 2)), (Shard(REPO, 1, 4, N_LAYERS), range(2, 4)),
                 (Shard(REPO, 1, 4, N_LAYERS), range(0))]  # (the shard, the layers it adds)
        for shard, new_layers in plans:
            seen = len(hub.requests())
            asyncio.run(downloader.ensure(model.manifest, model.folder, shard, False))
            fetched = cdn_ranges(hub.requests(since=seen))
            added = [span for layer in new_layers
                     for span in tensor_spans(original, Shard(REPO, layer, layer + 1, N_LAYERS))[original]]
            if shard.is_first and new_layers:
                added += tensor_spans(original, Shard(REPO, 0, 1, 2))[original]  # layer 0 and the embedding
            assert fetched == coalesce(added, 31)  # each range once, merged only across alignment padding
    finally:
        downloader.close()
    held = GGUFCheckpoint(model.folder)
    whole = GGUFCheckpoint(original)
    for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight"):
        assert np.array_equal(held.read(name), whole.read(name))
    assert not model.folder.read_bytes()[held.tensors["model.layers.5.mlp.up_proj.weight"].offset:][:4096].strip(b"\0")
    assert model.folder.read_bytes()[:end] == data[:end]


def test_offline_a_restarted_node_serves_the_ranges_it_holds(hub: HubServer, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    cache = tmp_path / "cache"
    model = fetch_hub_model(parse_model_name(REPO, tmp_path), cache)  # the repo's name ends in GGUF: the default tag
    assert model.folder.name == "tiny-Q8_0.gguf" and model.tag is None
    downloader = ShardDownloader(cache, "n0", DownloadProgress())
    try:
        asyncio.run(downloader.ensure(model.manifest, model.folder, Shard(REPO, 2, 4, N_LAYERS), False))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        seen = len(hub.requests())
        again = fetch_hub_model(parse_model_name(REPO, tmp_path), cache)
        assert (again.key, again.folder) == (model.key, model.folder)
        asyncio.run(downloader.ensure(again.manifest, again.folder, Shard(REPO, 2, 4, N_LAYERS), False))
        with pytest.raises(HubUnavailableError, match="HF_HUB_OFFLINE is set"):
            asyncio.run(downloader.ensure(again.manifest, again.folder, Shard(REPO, 3, 6, N_LAYERS), False))
        assert hub.requests(since=seen) == []
    finally:
        downloader.close()


def test_every_node_fetches_the_rope_freqs_with_the_headers(hub: HubServer, gguf_repos: dict[str, Path],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rope_freqs belongs to no layer, and every stage rotates: planning fetches its bytes with the headers, the
    config carries them to whichever stage a node holds, and no shard fetches them again."""
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    original = gguf_repos[LLAMA3] / "tiny-llama3-Q8_0.gguf"
    whole = GGUFCheckpoint(original)
    rope = whole.tensors["rope_freqs.weight"]
    head = header_end(original.read_bytes(), original.name)
    cache = tmp_path / "cache"
    seen = len(hub.requests())
    model = fetch_hub_model(parse_model_name(LLAMA3, tmp_path), cache)
    fetched = cdn_ranges(hub.requests(since=seen))
    assert [span for span in fetched if span[0] >= head] == [(rope.offset, rope.offset + rope.n_bytes)]
    assert model.args == ModelArgs.from_dict(whole.config()) and len(model.args.rope_freq_factors) == 32
    downloader = ShardDownloader(cache, "n0", DownloadProgress())
    try:
        shard = Shard(LLAMA3, 2, 4, N_LAYERS)  # a middle stage: no embedding, no head
        seen = len(hub.requests())
        asyncio.run(downloader.ensure(model.manifest, model.folder, shard, False))
        assert cdn_ranges(hub.requests(since=seen)) == coalesce(tensor_spans(original, shard)[original], 31)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a restarted node plans from what it holds
        seen = len(hub.requests())
        again = fetch_hub_model(parse_model_name(LLAMA3, tmp_path), cache)
        assert again.args == model.args and hub.requests(since=seen) == []
    finally:
        downloader.close()


# -- real nodes ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected(gguf_repos: dict[str, Path]) -> str:
    """transformers' greedy answer from the same file, loaded in float32."""
    path = gguf_repos[REPO] / "tiny-Q8_0.gguf"
    tokenizer = gguf_tokenizer(open_gguf(path).metadata, path.name)
    tokens = gguf_greedy(path, tokenizer.encode_chat(MESSAGES), MAX_TOKENS, stop_at_eos=True)
    assert len(set(tokens)) > 1, "degenerate reference continuation; pick another seed"
    return tokenizer.decode(tokens)


def hub_env(hub: HubServer, origin: str, root: Path) -> dict[str, str | None]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_USER_AGENT_ORIGIN": origin, "HF_HOME": str(root / f"hf-{origin}"),
            "HF_TOKEN": None, "HF_HUB_OFFLINE": None, "HF_HUB_CACHE": None}


def answer(node: NodeProcess, model: str) -> str:
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["message"]["content"]


def stages(node: NodeProcess, repo_id: str) -> dict[str, Shard]:
    plan = cluster_of(node)["plan"]
    return {s["node_id"]: Shard(repo_id, s["start_layer"], s["end_layer"], N_LAYERS) for s in plan["stages"]}


def assert_fetched_only_its_own(hub: HubServer, origin: str, original: Path, shard: Shard) -> None:
    """Every range the node fetched is a header read (it starts inside a part's header) or lies within its own
    tensors (with the alignment padding between them); every own tensor was fetched, once."""
    own_spans = tensor_spans(original, shard)
    parts = GGUFCheckpoint(original).parts
    for part in parts:
        spans, name = own_spans.get(part, []), part.name
        head = header_end(part.read_bytes(), name)
        assert head is not None
        fetched = cdn_ranges([r for r in hub.requests(origin) if r.file and r.file.endswith(name)])
        own = coalesce(spans, 31)
        for start, end in fetched:
            assert start < head or any(a <= start and end <= b for a, b in own), (name, start, end, own)
        assert subtract(coalesce(spans), coalesce(fetched)) == [], name
        body = [(start, end) for start, end in fetched if start >= head]
        assert sum(e - s for s, e in body) == sum(b - a for a, b in own)  # each byte once
    assert sum(e - s for s, e in cdn_ranges(hub.requests(origin))) < sum(p.stat().st_size for p in parts)


def test_three_nodes_fetch_only_their_own_ranges_and_match_transformers(hub: HubServer, gguf_repos: dict[str, Path],
                                                                       expected: str, tmp_path: Path) -> None:
    original = gguf_repos[REPO] / "tiny-Q8_0.gguf"
    nodes = start_cluster(tmp_path, None, [6, 3, 1], envs=[hub_env(hub, f"node{i}", tmp_path) for i in range(3)],
                          extra=BY_MEMORY)
    try:
        assert wait_for(lambda: all(len(cluster_of(node)["nodes"]) == 3 for node in nodes), timeout=30)
        assert answer(nodes[1], f"{REPO}:Q8_0") == expected
        wait_until_ready(nodes, members=3, timeout=60)
        plan = stages(nodes[0], REPO)
        assert len({(s.start_layer, s.end_layer) for s in plan.values()}) == 3
        for i, node in enumerate(nodes):
            node_id = cluster_of(node)["node_id"]
            assert_fetched_only_its_own(hub, f"node{i}", original, plan[node_id])
            download = next(n for n in cluster_of(nodes[0])["nodes"] if n["id"] == node_id)["download"]
            assert download["state"] == "complete" and download["done_bytes"] == download["total_bytes"] > 0
        for node, name in ((nodes[0], f"{REPO}:Q8_0"), (nodes[2], f"{REPO}:q8_0")):
            assert answer(node, name) == expected
        models = nodes[2].get_json("/v1/models")["data"]
        assert (models[0]["id"], models[0]["source"]) == (f"{REPO}:Q8_0", "hub")
    finally:
        for node, code in zip(nodes, stop_nodes(nodes)):
            assert code == 0, node.log()
            assert "Traceback" not in node.log(), node.log()


def test_a_split_gguf_in_a_subfolder_is_fetched_part_by_part(hub: HubServer, gguf_repos: dict[str, Path],
                                                            expected: str, tmp_path: Path) -> None:
    first = gguf_repos[SPLIT] / "Q8_0" / "tiny-Q8_0-00001-of-00003.gguf"
    assert first.is_file() and len(GGUFCheckpoint(first).parts) == 3
    # No --model: the nodes link first, so neither plans (and fetches) the whole model alone. No tag: Q4_K_M is
    # absent, so llama.cpp's next default, Q8_0, picks the set.
    nodes = start_cluster(tmp_path, None, [1, 1], envs=[hub_env(hub, f"split{i}", tmp_path) for i in range(2)],
                          extra=BY_MEMORY)
    try:
        assert wait_for(lambda: all(len(cluster_of(node)["nodes"]) == 2 for node in nodes), timeout=30)
        assert answer(nodes[0], SPLIT) == expected
        wait_until_ready(nodes, members=2, timeout=60)
        plan = stages(nodes[0], SPLIT)
        for i, node in enumerate(nodes):
            assert_fetched_only_its_own(hub, f"split{i}", first, plan[cluster_of(node)["node_id"]])
    finally:
        for node, code in zip(nodes, stop_nodes(nodes)):
            assert code == 0, node.log()


def test_a_tag_the_repo_lacks_fails_with_the_tags_it_has(hub: HubServer, tmp_path: Path) -> None:
    node = start_node(tmp_path, None, "--no-mdns", env=hub_env(hub, "bad-tag", tmp_path))
    try:
        body = json.dumps({"model": f"{REPO}:Q5_K_M", "messages": MESSAGES, "max_tokens": 2}).encode()
        status, _, raw = node.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        error = json.loads(raw)["error"]
        assert status == 404 and "F16, Q8_0" in error["message"], raw
        assert not any(r.path.startswith("/cdn/") for r in hub.requests("bad-tag"))  # nothing fetched
    finally:
        node.stop()
