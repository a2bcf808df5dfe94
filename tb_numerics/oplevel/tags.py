"""Tag names of op-level records: stable across steps, unique per op site.

An op site is where an op is made: a graph op (its graph and op name) or an
eager op (its name scope, type and source line). Each site gets one tag,
``ops/<name>``, with ``_1``, ``_2`` ... added where two sites share a name;
a site whose name ``name_regex`` does not match gets ``None``: not recorded.
"""

from __future__ import annotations

import re
from typing import Any, Hashable

__all__ = ["OpTags", "TAG_PREFIX", "eager_site", "graph_site"]

TAG_PREFIX = "ops/"


class OpTags:
    """The tag of every op site seen, and the filter on op names."""

    def __init__(self, name_regex: str | None = None) -> None:
        self._name_re = None if name_regex is None else re.compile(name_regex)
        self._tags: dict[Hashable, str | None] = {}
        self._owner: dict[str, Hashable] = {}

    def tag(self, site: Hashable, name: str) -> str | None:
        """The tag of ``site``, named after ``name``; None if filtered out."""
        if site in self._tags:
            return self._tags[site]
        tag: str | None = None
        if self._name_re is None or self._name_re.search(name):
            tag = TAG_PREFIX + name
            n = 0
            while tag in self._owner:
                n += 1
                tag = "%s%s_%d" % (TAG_PREFIX, name, n)
            self._owner[tag] = site
        self._tags[site] = tag
        return tag

    @staticmethod
    def op_name(tag: str) -> str:
        """The op's name in ``tag`` (``tag`` without the prefix)."""
        return tag[len(TAG_PREFIX):] if tag.startswith(TAG_PREFIX) else tag


def graph_site(graph: Any, own_graph: bool, op_name: str, slot: int) -> tuple[Any, ...]:
    """The site of output ``slot`` of a graph op."""
    return ("graph", None if own_graph else graph.name, op_name, slot)


def eager_site(name: str, where: str, slot: int) -> tuple[Any, ...]:
    """The site of output ``slot`` of an eager op."""
    return ("eager", name, where, slot)
