"""JSON round-trip for the plain dataclasses tierwise exchanges (Plan, Profile, Hardware)."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class JsonDataclass:
    """Mixin: ``to_json``/``from_json`` for dataclasses of JSON-friendly fields.

    Nested dataclasses (and lists/dicts of them) are rebuilt from their type hints; tuples come
    back as tuples.
    """

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in data:
                kwargs[f.name] = _rebuild(hints[f.name], data[f.name])
        return cls(**kwargs)

    @classmethod
    def from_json(cls: type[T], text_or_path: str | Path) -> T:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))  # type: ignore[attr-defined]


def _rebuild(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return hint.from_dict(value) if hasattr(hint, "from_dict") else hint(**value)
    if origin in (list, tuple) and args:
        item = args[0]
        items = [_rebuild(item, v) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict and len(args) == 2:
        return {k: _rebuild(args[1], v) for k, v in value.items()}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in args:
            if arg is type(None):
                continue
            if dataclasses.is_dataclass(arg) or typing.get_origin(arg) is not None:
                return _rebuild(arg, value)
        return value
    if hint is tuple and isinstance(value, list):
        return tuple(value)
    return value
