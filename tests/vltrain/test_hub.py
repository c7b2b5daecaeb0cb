"""The Hugging Face Hub without a network: `vltrain export --push-to-hub` against a stand-in for huggingface_hub's
HfApi (what it is asked to create and upload), and `vltrain.load("hf-hub:ORG/NAME")` against a stand-in
snapshot_download; a failed upload is one line and leaves the export complete."""

import pytest
from typer.testing import CliRunner

import vltrain
from tests.conftest import tiny_checkpoint
from vltrain.cli import app


class FakeApi:
    """Records huggingface_hub.HfApi's calls; `fail` makes the upload raise as an offline machine does."""

    calls: list = []
    fail = False

    def create_repo(self, repo_id, repo_type, private, exist_ok):
        FakeApi.calls.append(("create_repo", repo_id, repo_type, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path, repo_id, repo_type, commit_message):
        if FakeApi.fail:
            raise ConnectionError("no network")
        FakeApi.calls.append(("upload_folder", folder_path, repo_id, repo_type))


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeApi.calls = []
    FakeApi.fail = False
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return FakeApi


def test_push_to_hub_uploads_the_export_with_its_readme_as_the_model_card(tmp_path, fake_hub):
    ckpt = tiny_checkpoint(tmp_path / "tiny.pt")
    out = tmp_path / "export"
    r = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--push-to-hub", "me/tiny", "--private"])
    assert r.exit_code == 0, r.output
    assert fake_hub.calls == [("create_repo", "me/tiny", "model", True, True),
                              ("upload_folder", str(out), "me/tiny", "model")]
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: vltrain\ntags:\n- vltrain\n") and "\n---\n\n# " in card
    assert "uploaded" in r.output and "https://huggingface.co/me/tiny" in r.output


def test_a_failed_upload_is_one_line_and_the_export_stays(tmp_path, fake_hub):
    fake_hub.fail = True
    ckpt = tiny_checkpoint(tmp_path / "tiny.pt")
    out = tmp_path / "export"
    r = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--push-to-hub", "me/tiny"])
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: --push-to-hub me/tiny: the upload failed (ConnectionError)") and "huggingface-cli" \
        in line
    assert vltrain.load(out, device="cpu").encode_texts(["a dog"]).shape == (1, 16)  # the export is whole
    r = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "o2"), "--push-to-hub", "tiny"])
    assert r.exit_code == 2 and "give ORG/NAME" in r.output


def test_load_reads_an_export_from_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    ckpt = tiny_checkpoint(tmp_path / "tiny.pt")
    out = tmp_path / "export"
    assert CliRunner().invoke(app, ["export", str(ckpt), str(out)]).exit_code == 0
    asked = []

    def snapshot_download(repo_id, allow_patterns=None):
        asked.append(repo_id)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = vltrain.load("hf-hub:me/tiny", device="cpu")
    assert asked == ["me/tiny"]
    local = vltrain.load(out, device="cpu")
    assert (model.encode_texts(["a dog"]) == local.encode_texts(["a dog"])).all()

    def offline(repo_id, allow_patterns=None):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match=r"hf-hub:me/tiny: could not fetch 'me/tiny' .*\(OSError\)") as e:
        vltrain.load("hf-hub:me/tiny")
    assert "\n" not in str(e.value)
