"""The Hugging Face Hub, where a network is: `hf-hub:ORG/NAME` fetched into huggingface_hub's cache, and
`vltrain export --push-to-hub ORG/NAME` uploading an export with its README as the model card. Without a network
each is a one-line error naming the repository; credentials come from huggingface_hub's own login or HF_TOKEN and
never reach an error message."""

from pathlib import Path

from vlprep import cut

HUB = "hf-hub:"
# Model-card metadata per export layout: the library that loads the folder (the Hub shows its loading snippet)
LIBRARY = {"vltrain": "vltrain", "hf": "transformers", "open_clip": "open_clip"}


def is_hub(name) -> bool:
    return isinstance(name, str) and name.startswith(HUB)


def fetch(spec: str, patterns: list[str] | None = None) -> Path:
    """The local folder of `hf-hub:ORG/NAME` (downloaded once into huggingface_hub's cache); a one-line ValueError
    naming the id when it cannot be had (no network, an unknown or gated repository)."""
    repo = spec[len(HUB):]
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=patterns))
    except Exception as e:  # offline, unknown or gated: one line naming the id (never the token)
        raise ValueError(f"{cut(spec)}: could not fetch {cut(repr(repo))} from the Hugging Face Hub "
                         f"({type(e).__name__}); download it where a network is (huggingface-cli download) and give "
                         "the local folder") from None


def model_card(readme: str, layout: str, tags: list[str]) -> str:
    """The export README with the Hub's model-card front matter (library, tags) on top."""
    lines = ["---", f"library_name: {LIBRARY.get(layout, 'vltrain')}", "tags:"]
    lines += [f"- {t}" for t in ["vltrain", "vision-language", "contrastive-learning", *tags]]
    return "\n".join(lines + ["---", "", readme])


def push(out: Path, repo_id: str, layout: str, private: bool = False, api=None) -> str:
    """Upload the export folder `out` to the model repository `repo_id` (created if missing), its README.md turned
    into a model card; returns the repository's URL. `api`: an HfApi (huggingface_hub's, by default)."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"--push-to-hub {cut(repr(repo_id))}: give ORG/NAME (a user or organisation, then the "
                         "model's name)")
    readme = out / "README.md"
    tags = ["clip"] if layout in ("hf", "open_clip") else []
    readme.write_text(model_card(readme.read_text(encoding="utf-8"), layout, tags), encoding="utf-8")
    try:
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(out), repo_id=repo_id, repo_type="model",
                          commit_message="vltrain export")
    except Exception as e:  # offline, no login, no write access: one line; the export stays in OUT
        raise ValueError(f"--push-to-hub {cut(repo_id)}: the upload failed ({type(e).__name__}); the export is "
                         f"complete in {cut(str(out))}: upload it later with `huggingface-cli upload {repo_id} "
                         f"{cut(str(out))}`") from None
    return str(url)
