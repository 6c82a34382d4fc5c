"""Finding a model: the built-in catalog, a config.json on disk, or (with network) the Hugging Face Hub.

``resolve_model("llama-2-7b")``, ``resolve_model("meta-llama/Llama-2-7b-hf")``,
``resolve_model("path/to/config.json")`` and ``resolve_model("path/to/checkpoint/")`` all return a
:class:`~trainmem.models.ModelSpec`. The catalog is a folder of real ``config.json`` files shipped as package
data; each keeps its Hub repo id in ``_name_or_path``, which works as an alias.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ModelError
from .models import ModelSpec, UnsupportedModelType, read_config_file, spec_from_config


@lru_cache(maxsize=1)
def _catalog_files() -> dict[str, Any]:
    """Catalog name -> its JSON file (beside this module: importlib.resources would cost start-up time for the
    same folder, as the package is installed as files)."""
    folder = Path(__file__).parent / "catalog"
    return {f.name[: -len(".json")]: f for f in folder.iterdir() if f.name.endswith(".json")}


def catalog_names() -> list[str]:
    return sorted(_catalog_files())


@lru_cache(maxsize=None)
def catalog_config(name: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(_catalog_files()[name].read_text(encoding="utf-8"))
    return config


@lru_cache(maxsize=1)
def _lower_names() -> dict[str, str]:
    return {name.lower(): name for name in _catalog_files()}


@lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    """Lower-cased catalog names and Hub repo ids -> catalog name."""
    table: dict[str, str] = {}
    for name in _catalog_files():
        table[name.lower()] = name
        repo = catalog_config(name).get("_name_or_path")
        if repo:
            table[repo.lower()] = name
    return table


def catalog_spec(name: str) -> ModelSpec:
    config = catalog_config(name)
    return spec_from_config(config, name=name, source=config.get("_name_or_path", name))


def _hub_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    """One quick TCP connect, so that an offline machine gets its answer at once, not after minutes of retries."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _from_hub(repo_id: str, hub: bool) -> dict[str, Any]:
    """config.json from the local Hub cache, or, when ``hub`` allows it, fetched from the Hub (only that file); one
    clear line when that is impossible."""
    try:
        from huggingface_hub import constants, hf_hub_download
    except ImportError:
        raise ModelError(
            f"{repo_id!r} is not in the catalog (trainmem models lists it) and huggingface_hub is not installed "
            "to fetch its config; give a path to its config.json"
        ) from None
    try:
        return read_config_file(Path(hf_hub_download(repo_id, "config.json", local_files_only=True)))
    except Exception:  # not cached: fall through to the network
        pass
    if not hub:
        raise ModelError(
            f"{repo_id!r} is not in the catalog (trainmem models) or the local Hub cache; pass --hub (hub=True in "
            "Python) to fetch its config.json from the Hub, or give a path to its config.json"
        )
    if constants.HF_HUB_OFFLINE or not _hub_reachable(constants.ENDPOINT):
        raise ModelError(
            f"{repo_id!r} is not in the catalog and the Hub cannot be reached (offline) to fetch its config.json; "
            "give a path to its config.json"
        )
    try:
        path = hf_hub_download(repo_id, "config.json")
    except Exception as exc:  # huggingface_hub raises many types: repo not found, gated, HTTP errors
        raise ModelError(f"{repo_id!r}: could not fetch config.json from the Hub ({type(exc).__name__})") from None
    return read_config_file(Path(path))


def load_config(model: str | os.PathLike[str] | None, hub: bool = False) -> tuple[dict[str, Any], str, str]:
    """Return (config, display name, source) for a catalog name, a path, or a Hub repo id (from the local cache, or
    from the Hub if ``hub``)."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ModelError(f"a model is a catalog name, a Hub repo id or a path, got {type(model).__name__}")
    key = model.strip()
    if not key:
        raise ModelError("no model given: a catalog name (trainmem models), a Hub repo id or a path to a config.json")
    if len(key) > 255:
        raise ModelError(f"model name of {len(key)} characters; a catalog name, repo id or path is at most 255")
    # a catalog name is found without reading the catalog's 35 files for their repo ids
    name = _lower_names().get(key.lower()) or _aliases().get(key.lower())
    if name:
        config = catalog_config(name)
        return config, name, config.get("_name_or_path", name)
    path = Path(key).expanduser()
    if path.exists():
        label = path.parent.name if path.name == "config.json" else path.stem if path.is_file() else path.name
        return read_config_file(path), label or str(path), str(path)
    if key.endswith(".json") or key.startswith((".", "/", "~")):
        raise ModelError(f"{key}: no such file")
    if key.count("/") == 1 and all(key.split("/")):
        return _from_hub(key, hub), key.split("/")[1], key
    import difflib  # (only for the message)

    close = difflib.get_close_matches(key.lower(), list(_aliases()), n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(_aliases()[c] for c in close)}" if close else ""
    raise ModelError(
        f"unknown model {key!r}{hint}. Give a catalog name (trainmem models), a Hub repo id or a path to a config.json"
    )


def resolve_model_and_config(model: str | os.PathLike[str] | None, hub: bool = False) -> tuple[ModelSpec, dict[str, Any]]:
    """The ModelSpec of any model reference and the config it came from (read once). Unknown model_types are
    counted by transformers if it is installed. The network is used only if ``hub`` allows it."""
    config, name, source = load_config(model, hub)
    try:
        return spec_from_config(config, name=name, source=source), config
    except UnsupportedModelType as exc:
        from .meta_count import spec_by_building  # needs torch + transformers

        return spec_by_building(config, name=name, source=source, reason=str(exc)), config


def resolve_model(model: str, hub: bool = False) -> ModelSpec:
    """A ModelSpec for any model reference (see :func:`load_config`)."""
    return resolve_model_and_config(model, hub)[0]
