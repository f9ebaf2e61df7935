"""Structured output: a request's `response_format` or `tools` turned into a llama.cpp grammar (GBNF).

The JSON-schema-to-GBNF conversion is llama-cpp-python's (`llama_cpp.llama_grammar`, a port of llama.cpp's
json_schema_to_grammar). That converter silently ignores keywords it cannot express (`minimum`, `multipleOf`,
`not`, ...), so a schema is first walked here and any keyword outside what it enforces is refused by name: a client
that asked for a constraint either gets it or a 400, never output that breaks it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from governor.engine.chat import ChatRequest, Tool

if TYPE_CHECKING:
    from llama_cpp.llama_grammar import SchemaConverter

# Keywords the converter enforces (or that constrain nothing: annotations).
_ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
        "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "format",
        "minLength", "maxLength",
    }
)  # fmt: skip
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
     "writeOnly", "strict"}
)  # fmt: skip
_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


class SchemaRefused(ValueError):
    """A schema (or part of one) the grammar cannot enforce; `where` is the JSON pointer of the offending part."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where or '/'}: {message}")
        self.where = where
        self.reason = message

    def under(self, prefix: str) -> SchemaRefused:
        """The same refusal, located inside the request (`prefix` is where the schema sits)."""
        return SchemaRefused(prefix + self.where, self.reason)


def check_schema(schema: Any, where: str = "") -> None:
    """Raise SchemaRefused at the first keyword or value the converter would not enforce."""
    if isinstance(schema, bool):
        if schema is False:
            raise SchemaRefused(where, "the schema `false` allows nothing")
        return
    if not isinstance(schema, dict):
        raise SchemaRefused(where, f"a schema must be an object, not {type(schema).__name__}")
    for key, value in schema.items():
        at = f"{where}/{key}"
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            raise SchemaRefused(at, f"the keyword {key!r} is not supported by the grammar (it would be ignored)")
        if key == "type":
            for t in value if isinstance(value, list) else [value]:
                if t not in _TYPES:
                    raise SchemaRefused(at, f"unknown type {t!r}")
        elif key == "format" and value not in _FORMATS:
            raise SchemaRefused(at, f"the format {value!r} is not supported (only {sorted(_FORMATS)})")
        elif key == "$ref" and not (isinstance(value, str) and value.startswith("#/")):
            raise SchemaRefused(at, f"only local references (#/...) are supported, not {value!r}")
        elif key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise SchemaRefused(at, "must be an object")
            for name, sub in value.items():
                check_schema(sub, f"{at}/{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise SchemaRefused(at, "must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}/{i}")
        elif key in ("items", "additionalProperties") and not isinstance(value, bool):
            check_schema(value, at)
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise SchemaRefused(f"{where}/minLength", "minLength/maxLength together with pattern are not supported")
    if "allOf" in schema and ("properties" in schema or "anyOf" in schema or "oneOf" in schema):
        raise SchemaRefused(f"{where}/allOf", "allOf next to properties/anyOf/oneOf is not supported")


def _convert(schema: dict[str, Any], name: str) -> tuple[SchemaConverter, str]:
    """llama-cpp-python's converter, as its json_schema_to_gbnf drives it, with the top rule named `name`."""
    from llama_cpp.llama_grammar import SchemaConverter  # loads llama.cpp: only the engine process gets here

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)  # type: ignore[no-untyped-call]
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        rule = str(converter.visit(resolved, name))  # type: ignore[no-untyped-call]
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise SchemaRefused("", f"cannot be turned into a grammar: {exc}") from exc
    return converter, rule


def schema_grammar(schema: dict[str, Any]) -> str:
    check_schema(schema)
    converter, _ = _convert(schema, "")
    return str(converter.format_grammar())  # type: ignore[no-untyped-call]


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON of one call: {"name": <this tool>, "arguments": <its parameters>}, name first (it streams first)."""
    params = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
    }


def tools_grammar(tools: list[Tool], *, required: bool) -> str:
    """A call wrapped in <tool_call>...</tool_call> (Hermes' format, which Qwen and SmolLM2 were trained on);
    unless `required`, plain text that does not start with "<" instead."""
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            try:
                check_schema(tool.function.parameters)
            except SchemaRefused as exc:
                raise exc.under(f"/tools/{i}/function/parameters") from exc
    union = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    converter, call = _convert(union, "call")
    wrapped = f'"{TOOL_OPEN}" "\\n"? {call} "\\n"? "{TOOL_CLOSE}"'
    root = wrapped if required else f"{wrapped} | [^<] [^\\x00]*"
    return f"root ::= {root}\n{converter.format_grammar()}"  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Constraint:
    """What the answer must be: `grammar` (GBNF) and how the text is read back (`tools`: a call or text)."""

    grammar: str | None
    tools: list[Tool] | None  # set when the answer may be (or must be) a tool call


def constraint(req: ChatRequest) -> Constraint:
    """From `response_format` and `tools`/`tool_choice`; raises SchemaRefused for what cannot be enforced.

    Tools win over `response_format` when a call is possible (OpenAI applies the format to the text answer only).
    """
    tools = req.tools or None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none":
        if not tools:
            raise SchemaRefused("/tool_choice", "tool_choice needs `tools`")
        if not isinstance(choice, str):
            named = [t for t in tools if t.function.name == choice.function.name]
            if not named:
                raise SchemaRefused("/tool_choice", f"no tool named {choice.function.name!r} in `tools`")
            return Constraint(tools_grammar(named, required=True), named)
        return Constraint(tools_grammar(tools, required=choice == "required"), tools)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return Constraint(None, None)
    if fmt.type == "json_object":
        from llama_cpp.llama_grammar import JSON_GBNF

        return Constraint(JSON_GBNF, None)
    if fmt.json_schema is None:
        raise SchemaRefused("/response_format/json_schema", "type json_schema needs `json_schema`")
    try:
        return Constraint(schema_grammar(fmt.json_schema.json_schema), None)
    except SchemaRefused as exc:
        raise exc.under("/response_format/json_schema/schema") from exc


def pointer_to_param(where: str) -> str:
    """/response_format/json_schema/schema/properties/x -> response_format.json_schema.schema.properties.x"""
    return ".".join(_parts(where))


def _parts(where: str) -> Iterator[str]:
    for part in where.strip("/").split("/"):
        if part:
            yield part.replace("~1", "/").replace("~0", "~")
