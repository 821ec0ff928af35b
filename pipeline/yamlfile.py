"""YAML as a gpudet config may hold it: PyYAML's safe loader, bounded."""

from __future__ import annotations

from typing import Any

import yaml

from .errors import ConfigError, one_line


def shown(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: an error line names a value, never pastes a large one."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"


MAX_DEPTH = 16
"""How deeply a config's lists and mappings may nest (gpudet's keys need 4: model.anchor_sizes)."""


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the bounds a config needs: no aliases (`*name`: nested ones make a
    few lines grow to gigabytes, the "billion laughs"), nesting at most MAX_DEPTH deep (deeper
    would end in Python's RecursionError), and no key twice in one mapping (YAML's loaders keep
    the last, which would drop a section's settings without a word)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"line {mark.line + 1}: an alias (*{shown(self.peek_event().anchor, 30)[1:-1]}) "
                                 "is not taken in a gpudet config; write the value out")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep; a gpudet "
                                     "config needs 4 at most")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.YAMLError(f"line {key_node.start_mark.line + 1}: {shown(key, 40)} is given twice in "
                                         "one mapping (the second would replace the first); give each key once")
                seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, what: str) -> Any:
    """YAML text, parsed with BoundedLoader; ConfigError naming `what` (at most a few hundred
    characters) if it is not valid."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 (a safe loader)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:  # its constructors: a date 2001-13-45, !!int abc
        raise ConfigError(f"{what} is not valid YAML: {one_line(e)}") from None


