"""The chat template a user gives in place of the checkpoint's, as vLLM's ``--chat-template`` takes it (a Jinja file,
or the template text itself), and the content format a template takes message content in
(``--chat-template-content-format``: auto, string or openai).

The template renders every chat prompt, so it joins the block identity (``cache.identity.chat_template_hash``): a
server, and the router, planner and doctor that hash for it, must be given the same one. One definition of the two
options (``add_arguments``) serves ``kvprefix serve``, ``route``, ``simulate`` and ``doctor``.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass

from kvprefix.paths import check_readable_file

CONTENT_FORMATS = ("auto", "string", "openai")
# vLLM's test of a value that is not a readable file: template text has one of these, a mistyped path none.
_TEMPLATE_CHARACTERS = "{}\n"


@dataclass(frozen=True)
class ChatTemplate:
    """A template to render with instead of the checkpoint's (``text`` None: the checkpoint's own), and the content
    format to hand it message content in ("auto": the one the template reads, ``detect_content_format``)."""

    text: str | None = None
    content_format: str = "auto"

    def __post_init__(self) -> None:
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat template content format {self.content_format!r}; choose one of "
                             f"{', '.join(CONTENT_FORMATS)}")

    @classmethod
    def given(cls, value: str | None, content_format: str = "auto", option: str = "chat_template") -> ChatTemplate:
        """From what a user gives (a file, the text, or None), checked (``load_chat_template``)."""
        return cls(None if value is None else load_chat_template(value, option), content_format)


def load_chat_template(value: str, option: str = "--chat-template") -> str:
    """The template ``value`` names: a readable file's text, else ``value`` itself when it reads as template text
    (vLLM's rule: it has a brace or a newline). A one-line ValueError naming ``option`` for a file that cannot be
    read, a path that does not exist, or a template that does not compile."""
    if os.path.exists(value) or not any(c in value for c in _TEMPLATE_CHARACTERS):
        check_readable_file(value, option)  # a directory, an unreadable file, a mistyped path: PathError
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{option} {value}: cannot be read: {exc}") from None
        shown = value
    else:
        text, shown = value, "(the template text)"
    error = compile_error(text)
    if error:
        raise ValueError(f"{option} {shown}: the template does not compile: {error}")
    return text


@functools.lru_cache(maxsize=32)
def compile_error(template: str) -> str | None:
    """Why ``template`` does not compile in the environment templates render in (transformers'), or None."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        return f"{exc.message} (line {exc.lineno})"
    return None


def add_arguments(parser) -> None:
    """``--chat-template`` (stored as the template's text, checked while the command line is parsed) and
    ``--chat-template-content-format``, on a parser or an argument group."""
    parser.add_argument("--chat-template", metavar="FILE_OR_TEXT", action=_TemplateAction,
                        help="render chat prompts with this Jinja template instead of the checkpoint's: a file, or "
                             "the template text (vLLM's option). It joins the block identity: give the server, the "
                             "router, the planner and the doctor the same one")
    parser.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                        help="how message content reaches the template: string (text parts joined by newlines), "
                             "openai (a list of {type, text} parts), or auto: openai for a template that loops over "
                             "a message's content, else string (vLLM's option; default auto)")


def from_arguments(args: argparse.Namespace) -> ChatTemplate | None:
    """The template the parsed options give (``add_arguments``); None where they leave the checkpoint's as it is."""
    if args.chat_template is None and args.chat_template_content_format == "auto":
        return None
    return ChatTemplate(args.chat_template, args.chat_template_content_format)


class _TemplateAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        try:
            values = load_chat_template(values, option_string or "--chat-template")
        except ValueError as exc:
            parser.exit(2, f"{parser.prog}: {exc}\n")
        setattr(namespace, self.dest, values)


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" when ``template`` loops over a message's content (so it expects a list of parts), else "string";
    "string" too for a template this cannot read. vLLM's rule (``--chat-template-content-format auto``): a message
    is a loop variable over ``messages`` (or a variable set from it); the template loops over its content as
    ``message.content`` or ``message['content']`` (through filters, tests or slices too), over a macro parameter
    a call fills with a message's content, or, outside macros, over a variable named ``content``."""
    import jinja2
    import jinja2.nodes as nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
        loops = list(tree.find_all(nodes.For))
        lists = _names_set_from(tree, "messages")
        messages = {_target(loop) for loop in loops if _name_of(loop.iter) in lists}
        in_macros: dict[int, set[str]] = {}  # loop in a macro -> that macro's parameters filled with a content
        for macro in tree.find_all(nodes.Macro):
            params = _content_params(tree, macro, messages)
            for loop in macro.find_all(nodes.For):
                in_macros[id(loop)] = params
        for loop in loops:
            plain = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
            if (_content_of(loop.iter, messages) or (plain is not None and plain in in_macros.get(id(loop), ()))
                    or (plain == "content" and id(loop) not in in_macros)):
                _target(loop)
                return "openai"
    except (_Unreadable, jinja2.TemplateError):
        pass
    return "string"


class _Unreadable(Exception):
    """A template whose loop or assignment over the messages does not bind a plain name (vLLM reads such a template
    as "string")."""


def _through(node):
    """The expression a filter, a test or a slice is applied to (``messages|reverse``, ``messages[1:]``)."""
    import jinja2.nodes as nodes

    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _name_of(node) -> str | None:
    import jinja2.nodes as nodes

    node = _through(node)
    return node.name if isinstance(node, nodes.Name) and node.ctx == "load" else None


def _content_of(node, messages: set[str]) -> bool:
    """Whether ``node`` is ``m.content`` or ``m['content']`` of a message variable ``m``."""
    import jinja2.nodes as nodes

    node = _through(node)
    if isinstance(node, nodes.Getattr):
        key = node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        key = node.arg.value
    else:
        return False
    return key == "content" and isinstance(node.node, nodes.Name) and node.node.name in messages


def _target(loop) -> str:
    import jinja2.nodes as nodes

    if not isinstance(loop.target, nodes.Name):
        raise _Unreadable
    return loop.target.name


def _names_set_from(tree, name: str) -> set[str]:
    """``name`` and every variable set from it, or from one of those (``{% set rest = messages[1:] %}``)."""
    import jinja2.nodes as nodes

    found, grew = {name}, True
    while grew:
        grew = False
        for assign in tree.find_all(nodes.Assign):
            if _name_of(assign.node) in found:
                if not isinstance(assign.target, nodes.Name):
                    raise _Unreadable
                if assign.target.name not in found:
                    found.add(assign.target.name)
                    grew = True
    return found


def _content_params(tree, macro, messages: set[str]) -> set[str]:
    """The parameters of ``macro`` that a call fills with a message's content, by position or by keyword."""
    import jinja2.nodes as nodes

    names = [arg.name for arg in macro.args]
    params = set()
    for call in tree.find_all(nodes.Call):
        if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
            continue
        params.update(names[i] for i, arg in enumerate(call.args[:len(names)]) if _content_of(arg, messages))
        params.update(k.key for k in call.kwargs if k.key in names and _content_of(k.value, messages))
    return params
