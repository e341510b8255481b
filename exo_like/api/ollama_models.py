"""Ollama's model endpoints: GET /api/tags (what this node can serve), POST /api/show (one model's details, chat
template and capabilities), GET /api/ps (the model loaded) and GET /api/version; and the helpers both Ollama
modules share (ollama_api.py serves /api/chat and /api/generate).

Built from the node's model listing (GET /v1/models: the served model first, then local folders, downloaded repos
and the catalog) and, for the served model, its description: config, weights and chat template (a Jinja template,
where Ollama's are Go templates). Ollama's fields with no counterpart here are empty (modelfile, parameters: a
Modelfile's settings) or fixed (size_vram 0; expires_at far ahead, as a served model stays loaded).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from exo_like import __version__
from exo_like.api.lifecycle import NODE_KEY, read_json
from exo_like.api.requests import checked_text, json_type, require_object
from exo_like.api.tool_calls.detect import detect
from exo_like.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from exo_like.models.gguf.file import GGUF_SUFFIX, open_gguf
from exo_like.models.names.resolver import LoadedModel
from exo_like.models.parameters import count_parameters
from exo_like.node import Node

# The Ollama API level claimed, with this server's own version as a semver pre-release: clients gate features on
# the version (VS Code's Copilot wants 0.6.4 or later) and parse it as Open WebUI does, dropping what follows "-".
OLLAMA_API_LEVEL = "0.12.0"
VERSION = f"{OLLAMA_API_LEVEL}-exo-like.{__version__}"
LOADED_UNTIL = "2999-12-31T23:59:59.000000Z"  # /api/ps's expires_at: the served model is never unloaded
_FLOAT_LEVELS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)


async def tags(request: web.Request) -> web.Response:
    """The listing in Ollama's shape; entries naming a served model (by any of its names) describe it."""
    node = request.app[NODE_KEY]
    models = []
    for entry in node.lifecycle.listing():
        served = _served_by(node, entry)
        models.append({**await _summary(served), "name": entry["id"], "model": entry["id"]} if served is not None
                      else _listed(entry))
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    body = require_object(await read_json(request))
    name = text(body, "model") or text(body, "name")  # `name` is the field's old spelling
    if not name:
        raise invalid("model is required: a non-empty string", "model", "missing_required_parameter")
    node = request.app[NODE_KEY]
    try:
        entry = node.lifecycle.entry(name)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"model '{name}' not found") from None
    served = _served_by(node, entry)
    if served is None:
        return web.json_response(_shown_by_name(entry))
    summary = await _summary(served)
    return web.json_response({"modelfile": "", "parameters": "", "template": served.tokenizer.chat_template_source
                              or "", "details": summary["details"], "model_info": _model_info(served),
                              "capabilities": capabilities(served), "modified_at": summary["modified_at"]})


def _served_by(node: Node, entry: dict[str, Any]) -> LoadedModel | None:
    """The served model a listing entry names (None: the entry is not one the cluster serves)."""
    if entry.get("state") not in ("serving", "loading"):
        return None
    names = {entry["id"], entry.get("repo"), entry.get("path")} - {None}
    for model in node.lifecycle.served():
        listed = model.listing()
        if names & {listed["id"], listed.get("repo"), listed.get("path")}:
            return model
    return None


def _shown_by_name(entry: dict[str, Any]) -> dict[str, Any]:
    """A model known by name only (its files are read once it is served): what the listing says of it."""
    listed = _listed(entry)
    info = {"general.architecture": listed["details"]["family"], "general.basename": entry["id"]}
    return {"modelfile": "", "parameters": "", "template": "", "details": listed["details"], "model_info": info,
            "capabilities": ["completion"], "modified_at": listed["modified_at"]}


async def ps(request: web.Request) -> web.Response:
    """The models the cluster has loaded (each instance's layers spread over its nodes), with when each is
    unloaded if no request comes (its keep_alive)."""
    node = request.app[NODE_KEY]
    loaded = []
    for model in node.lifecycle.served():
        ready = [i for i in node.instances.of(model.key) if i.ready] if node.instances is not None else []
        if not ready:
            continue
        summary = await _summary(model)
        left = [node.instances.expires_in(i.key) for i in ready]
        expires = None if None in left else max(left)  # type: ignore[type-var]
        loaded.append({**{key: summary[key] for key in ("name", "model", "size", "digest", "details")},
                       "expires_at": LOADED_UNTIL if expires is None else timestamp(time.time() + expires),
                       "size_vram": 0, "context_length": model.args.context_length})
    return web.json_response({"models": loaded})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


def capabilities(model: LoadedModel) -> list[str]:
    """completion always; tools when the chat template can show them to the model."""
    tools = detect(model.args.model_type, model.tokenizer.chat_template_source) is not None
    return ["completion", *(["tools"] if tools else [])]


async def _summary(model: LoadedModel) -> dict[str, Any]:
    """The served model's /api/tags entry (a GGUF header may be read for its quantization: off the loop)."""
    details = await asyncio.to_thread(_details, model)
    return {"name": model.model_id, "model": model.model_id, "modified_at": timestamp(model.created),
            "size": model.to_json()["bytes"], "digest": _digest(model.key), "details": details}


def _details(model: LoadedModel) -> dict[str, Any]:
    family = model.args.model_type
    return {"parent_model": "", "format": "gguf" if _is_gguf(model) else "safetensors", "family": family,
            "families": [family], "parameter_size": _parameter_size(count_parameters(model.args).total),
            "quantization_level": _quantization_level(model)}


def _listed(entry: dict[str, Any]) -> dict[str, Any]:
    """A model known by its listing only: a local folder or file, a downloaded repo, a catalog name."""
    name = entry["id"]
    family = entry.get("family") or entry.get("architecture") or ""
    parameters = entry.get("parameters")
    spelled = f"{entry.get('path') or ''} {entry.get('repo') or ''} {name}".lower()
    details = {"parent_model": "", "format": "gguf" if "gguf" in spelled else "safetensors", "family": family,
               "families": [family] if family else [],
               "parameter_size": _parameter_size(parameters) if isinstance(parameters, int) else "",
               "quantization_level": ""}
    return {"name": name, "model": name, "modified_at": timestamp(entry["created"]),
            "size": entry.get("size_bytes") or 0, "digest": _digest(name), "details": details}


def _model_info(model: LoadedModel) -> dict[str, Any]:
    """GGUF-style keys, as Ollama shows them (clients read `<architecture>.context_length`)."""
    args, arch = model.args, model.args.model_type
    return {"general.architecture": arch, "general.basename": model.model_id,
            "general.parameter_count": count_parameters(args).total,
            f"{arch}.context_length": args.context_length, f"{arch}.embedding_length": args.hidden_size,
            f"{arch}.block_count": args.num_hidden_layers, f"{arch}.feed_forward_length": args.intermediate_size,
            f"{arch}.attention.head_count": args.num_attention_heads,
            f"{arch}.attention.head_count_kv": args.num_key_value_heads, f"{arch}.attention.key_length": args.head_dim,
            f"{arch}.attention.layer_norm_rms_epsilon": args.rms_norm_eps, f"{arch}.rope.freq_base": args.rope_theta,
            f"{arch}.vocab_size": args.vocab_size}


def _is_gguf(model: LoadedModel) -> bool:
    return model.path.suffix == GGUF_SUFFIX  # a GGUF model's path is its (first) file


def _quantization_level(model: LoadedModel) -> str:
    """As Ollama names it: a GGUF file's type (Q4_K_M, Q8_0, F16, ...), an MLX checkpoint's bits, else its dtype."""
    if _is_gguf(model):
        from gguf import LlamaFileType  # only nodes serving a GGUF model need gguf

        try:
            kind = LlamaFileType(int(open_gguf(model.path).metadata["general.file_type"]))
        except (KeyError, ValueError, TypeError, UnsupportedModelError):
            return "unknown"
        return kind.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    quant = model.args.quant
    if quant is not None:
        return "MXFP4" if quant.mxfp4 else f"Q{quant.bits}"
    dtype = model.args.torch_dtype
    return _FLOAT_LEVELS.get(dtype, dtype.upper())


def _parameter_size(count: int) -> str:
    """135M, 1.5B, as Ollama shows parameter counts."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}".removesuffix(".0") + unit
    return str(count)


def _digest(name: str) -> str:
    """Ollama's digests name model files; here a model's key stands for them (one digest per model)."""
    return hashlib.sha256(name.encode()).hexdigest()


# -- fields of requests, and times (both Ollama modules use them) ------------------------------------------------------


def invalid(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def text(container: dict[str, Any], name: str, where: str | None = None) -> str:
    """A text field ("" when absent) the tokenizer can take: JSON's "\\ud800" escape decodes to a lone surrogate,
    which is no Unicode character."""
    value, where = container.get(name), where or name
    if value is None:
        return ""
    if not isinstance(value, str):
        raise invalid(f"{where} must be a string, not {json_type(value)}", where, "invalid_type")
    return checked_text(value, where)


def number(options: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value, where = options.get(name), f"options.{name}"
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{where} must be a number, not {json_type(value)}", where, "invalid_type")
    if not math.isfinite(value) or not low <= value <= high:
        raise invalid(f"{where} must be between {low:g} and {high:g}; got {value}", where)
    return float(value)


def integer(options: dict[str, Any], name: str, low: int, high: int, default: int, where: str = "") -> int:
    """An integer; a number with no fraction counts (JSON has one number type, and some clients write 40.0)."""
    value, where = options.get(name), where or f"options.{name}"
    if value is None:
        return default
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        shown = json.dumps(value)[:40] if isinstance(value, float) else json_type(value)
        raise invalid(f"{where} must be an integer, not {shown}", where, "invalid_type")
    if not low <= value <= high:
        raise invalid(f"{where} must be between {low} and {high}; got {value}", where)
    return int(value)


def timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes times (now, or `seconds` after the epoch)."""
    moment = datetime.now(timezone.utc) if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
