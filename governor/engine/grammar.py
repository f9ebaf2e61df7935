"""Structured output: a request's `response_format` or `tools` turned into a llama.cpp grammar (GBNF).

The JSON-schema-to-GBNF conversion is llama-cpp-python's (`llama_cpp.llama_grammar`, a port of llama.cpp's
json_schema_to_grammar). That converter silently ignores keywords it cannot express (`minimum`, `multipleOf`,
`not`, ...), so a schema is first walked here and any keyword outside what it enforces is refused by name: a client
that asked for a constraint either gets it or a 400, never output that breaks it.

The converter writes a bounded repetition out in full (`maxLength: N` becomes N nested optional groups in the
grammar's text, and llama.cpp's parser recurses once per group), so every count (`minLength`, `maxLength`,
`minItems`, `maxItems`, a pattern's `{m,n}`) is bounded here, and so is their sum over the whole request: one valid
JSON body asking for `maxLength: 1000000000` grew the engine past 9 GB before it was killed (issue 33).
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

_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
MAX_REPEAT = 1000  # one count: llama.cpp parses a grammar nested this deep, and refuses deeper
MAX_EXPANSION = 65536  # every count of the request, and the patterns' repetitions multiplied out, together
MAX_GRAMMAR_CHARS = 1 << 20  # its text: nesting grows it faster than the schema (600 arrays deep: 2.7 MB)

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


class _Budget:
    """The repetitions a request asks for, added up: past MAX_EXPANSION it is refused where the sum went over."""

    def __init__(self) -> None:
        self.used = 0

    def spend(self, where: str, amount: int) -> None:
        self.used += amount
        if self.used > MAX_EXPANSION:
            raise SchemaRefused(where, f"the schema's repetitions add up to more than {MAX_EXPANSION}")


def _count(schema: dict[str, Any], key: str, where: str, budget: _Budget) -> None:
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaRefused(where, f"must be a whole number, not {json.dumps(value)[:40]}")
    if not 0 <= value <= MAX_REPEAT:
        raise SchemaRefused(where, f"must be between 0 and {MAX_REPEAT}, not {value}")
    budget.spend(where, value)


def pattern_expansion(pattern: str) -> int:
    """How many atoms `pattern` becomes once its `{m,n}` repetitions are written out (the converter inlines a
    group, so `(a{100}){100}` is 10,000), capped early: past MAX_EXPANSION the exact figure does not matter."""
    sizes: list[int] = [0]  # the open groups' sizes so far, innermost last
    last = 0  # the size of the atom a quantifier would repeat
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "(":
            sizes.append(0)
            last = 0
        elif c == ")" and len(sizes) > 1:
            last = sizes.pop()
            sizes[-1] += last
        elif c == "{":
            end = pattern.find("}", i)
            end = len(pattern) if end < 0 else end
            fields = [f.strip() for f in pattern[i + 1 : end].split(",")]
            if any(len(f) > 9 for f in fields):
                return MAX_EXPANSION + 1
            times = max((int(f) for f in fields if f.isdigit()), default=1)
            i = end
            if times > MAX_REPEAT:
                return MAX_EXPANSION + 1
            sizes[-1] += last * (times - 1)
            last = 0
        else:
            if c == "\\":
                i += 1
            elif c == "[":
                end = pattern.find("]", i + 2)
                i = len(pattern) if end < 0 else end
            last = 1
            sizes[-1] += 1
        if sizes[-1] > MAX_EXPANSION:
            return MAX_EXPANSION + 1
        i += 1
    return sum(sizes)


def check_schema(schema: Any, where: str = "", budget: _Budget | None = None) -> None:
    """Raise SchemaRefused at the first keyword or value the converter would not enforce, or that asks for a
    grammar too large to build (`budget`: shared by every schema of one request)."""
    budget = _Budget() if budget is None else budget
    budget.spend(where, 1)  # every schema counts: 100,000 enum values or properties are a bomb too
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
                check_schema(sub, f"{at}/{name}", budget)
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise SchemaRefused(at, "must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}/{i}", budget)
        elif key in ("items", "additionalProperties") and not isinstance(value, bool):
            check_schema(value, at, budget)
        elif key in _COUNTS:
            _count(schema, key, at, budget)
        elif key == "enum" and isinstance(value, list):
            budget.spend(at, len(value))
        elif key == "pattern":
            if not isinstance(value, str):
                raise SchemaRefused(at, "must be a string")
            budget.spend(at, pattern_expansion(value))
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        if low in schema and high in schema and schema[low] > schema[high]:
            raise SchemaRefused(f"{where}/{low}", f"{low} {schema[low]} is above {high} {schema[high]}")
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
    size = sum(len(rule) + len(name) for name, rule in converter._rules.items())
    if size > MAX_GRAMMAR_CHARS:
        raise SchemaRefused("", f"its grammar would be {size} characters, over {MAX_GRAMMAR_CHARS} (nested too deeply)")
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
    budget = _Budget()
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            try:
                check_schema(tool.function.parameters, budget=budget)
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
