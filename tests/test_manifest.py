"""The manifest's typed record: manifests written before it still read, and every defect is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import MANIFEST
from zckpt_nb.format.manifest import FileEntry, Manifest, commit, parse, read_manifest

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name", ["manifest_v1_save.json", "manifest_v1_dcp.json"])
def test_manifests_written_before_the_typed_record_still_read(name):
    """Kept byte for byte as the package wrote them before format.manifest held a typed record."""
    text = (DATA / name).read_text()
    manifest = parse(json.loads(text))
    assert manifest.tag == "global_step4" and manifest.step == 4 and manifest.files
    assert all(isinstance(e, FileEntry) and len(e.sha256) == 64 for e in manifest.files)
    if manifest.kind is None:  # a save: ranks, nodes, the shared files beside the tags
        assert manifest.world_size == 2 and {e.rank for e in manifest.files} == {0, 1}
        assert [e.path for e in manifest.shared] == ["tokenizer.json", "tokenizer_config.json", "config.json"]
    else:
        assert manifest.kind == "dcp" and manifest.conversion["route"] == "universal copy"
    written = json.loads(manifest.to_json())  # written again: the same facts ("rank": null left out)
    expected = json.loads(text)
    for entry in expected["files"] + expected.get("shared", []):
        entry.pop("rank") if entry["rank"] is None else None
    assert written == expected and parse(written) == manifest


def good() -> dict:
    return json.loads((DATA / "manifest_v1_save.json").read_text())


def defect(change):
    record = good()
    change(record)
    return record


@pytest.mark.parametrize("record, message", [
    (defect(lambda r: r["files"][0].update(bytes="25420")), "files[0]'s 'bytes' is \"25420\", not a JSON int"),
    (defect(lambda r: r["files"][1].pop("sha256")), "files[1] has no 'sha256'"),
    (defect(lambda r: r.update(files={})), "'files' is {}, not a JSON list"),
    (defect(lambda r: r["files"][0].update(path="zero_pp\0rank.pt")), "which is not a relative path of a file"),
    (defect(lambda r: r["files"][0].update(path="../escape.pt")), "which is not a relative path of a file"),
    (defect(lambda r: r["files"].append(dict(r["files"][0]))), "_model_states.pt' twice"),
    (defect(lambda r: r["files"][0].update(bytes=2**60)), "claims 1,152,921,504,606,846,976 bytes"),
    (defect(lambda r: r["files"][0].update(sha256="beef")), "has no SHA-256"),
    (defect(lambda r: r.update(world_size=True)), "'world_size' is true, not a JSON int"),
    (defect(lambda r: r.pop("world_size")), "has no 'world_size'"),
    (defect(lambda r: r.pop("tag")), "has no 'tag'"),
    (defect(lambda r: r.update(format="zckpt-manifest/2")), "this zckpt_nb reads version 1"),
    (defect(lambda r: r.update(format="something else")), "not a zckpt_nb manifest"),
    (defect(lambda r: r.update(kind="tarball")), "describes a 'tarball' folder"),
    ([good()], "not a zckpt_nb manifest"),
])
def test_every_defect_of_a_manifest_is_one_line_naming_it(tmp_path, record, message):
    (tmp_path / MANIFEST).write_text(json.dumps(record))
    with pytest.raises(CheckpointError) as refused:
        read_manifest(tmp_path)
    said = str(refused.value)
    assert message in said and str(tmp_path / MANIFEST) in said and "\n" not in said, said


def test_a_manifest_too_large_or_not_json_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / MANIFEST
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # a sparse gigabyte: refused by its size, never read
    with pytest.raises(CheckpointError, match="larger than 16 MiB"):
        read_manifest(tmp_path)
    path.write_text("[" * 100_000)  # nesting deeper than the parser's stack
    with pytest.raises(CheckpointError, match="unusable"):
        read_manifest(tmp_path)
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(CheckpointError, match="unusable"):
        read_manifest(tmp_path)


def test_commit_writes_the_manifest_last_and_it_reads_back_equal(tmp_path):
    folder = tmp_path / "global_step1"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.pt").write_bytes(b"abc")
    entry = FileEntry("sub/a.pt", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", rank=0, node=0)
    manifest = Manifest("global_step1", 1, [entry], world_size=1, identity={"model": "tiny"})
    commit(folder, manifest)
    assert read_manifest(folder) == manifest and not (folder / f"{MANIFEST}.tmp").exists()


def test_a_folder_of_saves_without_a_manifest_is_refused_with_adopt_named(tmp_path):
    from zckpt_nb.convert.verify import tag_to_resume

    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"DeepSpeed's")
    with pytest.raises(CheckpointError, match=r"global_step2 is a complete save another tool wrote .*zckpt_nb adopt"):
        tag_to_resume(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds zckpt_manifest.json\)$"):
        tag_to_resume(tmp_path / "empty")
