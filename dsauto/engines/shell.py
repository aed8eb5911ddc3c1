"""A launch script read as bash runs it: its variables, arrays, arithmetic and branches
(:func:`expand_shell_variables`), so that dsauto.engines.megatron_args reads the command it builds.

Megatron-LM's example scripts gather their flags in bash arrays, size the launch with variables and
add flags in ``if`` blocks (``if [[ "$DTYPE" == "fp8" ]]; then DTYPE_ARGS+=(...)``). What the file
decides is evaluated as bash would; what depends on the job (``$SLURM_NNODES``, ``$1``, a file test)
is left as written, or, where it decides a branch, reported."""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from dataclasses import dataclass

_ASSIGNMENT = re.compile(r"(?:export[ \t]+|declare[ \t]+-a[ \t]+|local[ \t]+)?([A-Za-z_]\w*)(\+?)=")
_QUOTED_ARRAY = re.compile(r"\"(\$\{[A-Za-z_]\w*\[@\]\})\"")  # "${NAME[@]}"; "${NAME[*]}" is one word
_REFERENCE = re.compile(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}|\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")
_DEFAULTED = re.compile(r"\$\{([A-Za-z_]\w*|\d+)(:?)([-=])")  # a positional argument's too: ${1:-default}
_ARITHMETIC = re.compile(r"[\d\s+\-*/%()]+")
_INTEGER = re.compile(r"-?\d+")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_]\w*)\1")
_WORD = re.compile(r"""(?:[^\s'"\\]|\\.|'[^']*'|"(?:[^"\\]|\\.)*")+""", re.DOTALL)
_CASE_ARM = re.compile(r"\(?[^()\s][^()]*\)\s*")
_BLOCK_OPENERS = ("if", "case", "for", "while", "until", "select")


def is_assignment(word: str) -> bool:
    """Whether a command word is a variable assignment (``NAME=value``), not a command."""
    return bool(_ASSIGNMENT.match(word)) and "=" in word


def expand_shell_variables(text: str, defaults: dict[str, str] | None = None,
                           unevaluated: dict[str, str] | None = None, job: dict[str, str] | None = None) -> str:
    """``text`` with the bash arrays it defines (``NAME=( ... )``, ``NAME+=( ... )``) taken out and
    each ``${NAME[@]}`` replaced by their words, and each ``$NAME`` / ``${NAME}`` of a variable it
    sets to one value (``NAME=value``, ``export NAME=value``, a quoted value over several lines
    too) replaced by that value, as Megatron-LM's example launch scripts build their command
    (``torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...``): unquoted, an
    element or a value splits into words at its blanks, as bash splits it, quoted it stays one word
    (each element one word in ``"${NAME[@]}"``, all of them one in ``"${NAME[*]}"``). A variable set
    outside the file (``$1``, ``$NNODES`` from the job) stays as written, and nothing inside single
    quotes, a comment or a here-document is expanded.

    Branches run as bash runs them where the file decides them: ``if``/``elif``/``else``/``fi``
    (one-line ones and commands after ``then``/``else`` too) and ``TEST && command`` /
    ``TEST || command``, over tests of the file's own values (``[[ ... ]]``, ``[ ... ]``, ``test``:
    string comparisons, patterns and ``=~`` in ``[[ ]]`` where the right side is unquoted, integer
    comparisons, ``-z``, ``-n``, ``!``, ``&&`` binding tighter than ``||``): the branch taken sets
    what it sets, the others are left out. A branch the file cannot decide (a test over what the
    job sets, a file test, arithmetic), and the bodies of ``case`` blocks and loops, set nothing:
    each variable they would set is added to ``unevaluated`` with the test, for the caller to say
    so; their other commands stay in the text.

    ``${NAME:-default}`` (and ``${NAME-default}``; ``${NAME:=default}`` also sets NAME) takes the
    file's value of NAME, else its default, as bash does where the job does not set NAME: each
    default taken is added to ``defaults`` by name, for the caller to say so; ``job`` gives values
    as if the job set them. Integer arithmetic ``$((...))`` over numbers and the file's whole-number
    variables is computed as bash computes it (division and remainder truncated towards zero); one
    over anything else stays as written."""
    shell = _Shell(dict(job or {}), {}, {} if defaults is None else defaults,
                   {} if unevaluated is None else unevaluated)
    out: list[str] = []
    pos, heredoc = 0, None
    while pos < len(text):
        end = _logical_line_end(text, pos)
        line, pos = text[pos:end], end
        if heredoc is not None:  # a here-document's lines are input, not commands
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        found = _HEREDOC.search(line) if "<<" in line else None
        heredoc = found.group(2) if found and not _quoted_at(line, found.start()) else None
        out.append(shell.run(line))
    return "".join(out)


@dataclass
class _Block:
    """An open compound command of a launch script: an ``if`` block, a ``case`` or a loop."""

    kind: str
    """``if``, ``case`` or ``loop``."""
    test: str
    """What decides it, as written (for the report of what it would set)."""
    parent: bool | None
    """Whether the commands around the block run (three-valued: None where the file cannot tell)."""
    own: bool | None
    """Whether its branch being read runs, given its surroundings do."""
    taken: bool | None = False
    """``if``: whether an earlier branch of the block ran."""

    @property
    def runs(self) -> bool | None:
        return _both(self.parent, self.own)


class _Shell:
    """The variables, arrays and open blocks of a launch script as :func:`expand_shell_variables`
    reads it, line by line."""

    def __init__(self, scalars: dict[str, str], arrays: dict[str, list[str]], defaults: dict[str, str],
                 unevaluated: dict[str, str]):
        self.scalars, self.arrays, self.defaults, self.unevaluated = scalars, arrays, defaults, unevaluated
        self.blocks: list[_Block] = []

    def runs(self) -> bool | None:
        """Whether the command being read runs: True, False, or None where the file cannot tell."""
        return self.blocks[-1].runs if self.blocks else True

    def run(self, line: str) -> str:
        """The logical line ``line`` as the text to read words from: the commands that run (or may),
        expanded; the variables and blocks it sets kept for the lines after it. A whole-line comment
        is kept as written (dsauto's own file states its launch environment in one)."""
        if line.lstrip().startswith("#"):
            return line
        outputs, status = [], True
        for link, statement in _statements(line):
            here = self.runs()
            if link == "&&":
                here = _both(here, status)
            elif link == "||":
                here = _both(here, _not(status))
            if here is False and link in ("&&", "||"):
                continue  # skipped: the list's status stays that of the command before
            status, written = self.statement(statement, here)
            if written:
                outputs.append(written)
        return " ; ".join(outputs) + ("\n" if line.endswith("\n") else "")

    def statement(self, text: str, here: bool | None) -> tuple[bool | None, str]:
        """(exit status, text to keep) of one simple or compound-command word list ``text``, which runs
        as ``here`` says."""
        first, rest = (text.split(None, 1) + [""])[:2] if text.strip() else ("", "")
        rest = rest.strip()
        block = self.blocks[-1] if self.blocks else None
        if first == "if":
            parent = self.runs()
            self.blocks.append(_Block("if", rest, parent, self.test(rest) if parent is True else None))
            return True, ""
        if first in ("then", "do"):
            return self.statement(rest, self.runs()) if rest else (True, "")
        if first == "elif" and block is not None and block.kind == "if":
            block.taken = _either(block.taken, block.own)
            decided = self.test(rest) if block.parent is True and block.taken is not True else None
            block.own = False if block.taken is True else decided if block.taken is False else (
                False if decided is False else None)
            block.test = rest
            return True, ""
        if first == "else" and block is not None and block.kind == "if":
            block.taken = _either(block.taken, block.own)
            block.own = _not(block.taken)
            return self.statement(rest, self.runs()) if rest else (True, "")
        if first in ("fi", "esac", "done") and block is not None:
            self.blocks.pop()
            return True, ""
        if first in _BLOCK_OPENERS:  # case and loops: their bodies are not evaluated
            self.blocks.append(_Block("case" if first == "case" else "loop", text, self.runs(), None))
            return None, ""
        if block is not None and block.kind == "case" and (arm := _CASE_ARM.match(text)):
            return self.statement(text[arm.end():], here) if text[arm.end():].strip() else (True, "")
        match = _ASSIGNMENT.match(text)
        if match:
            self.assign(match, text, here)
            array = text.startswith("(", match.end())  # its words live on in the array, not here
            return True, self.substitute(text) if here is True and not array else ""
        if first in ("[[", "[", "test", "!"):
            return (self.test(text) if here is True else None), ""
        if here is False or not text:
            return None, ""
        return None, self.substitute(text)

    def assign(self, match: re.Match[str], text: str, here: bool | None) -> None:
        """Sets the variable or array of the assignment ``text`` where it runs; where the file cannot
        tell, reports it."""
        name, append = match.group(1), match.group(2)
        if here is not True:
            if here is None:
                # the outermost block the file cannot decide is why
                self.unevaluated.setdefault(name, next((b.test for b in self.blocks if b.own is None),
                                                       "a list over a command's status"))
            return
        value = text[match.end():]
        if value.startswith("("):
            close = _closing_parenthesis(value, 1)
            words = shlex.split(self.substitute(value[1:close]).replace("\\\n", " "), comments=True)
            self.arrays[name] = self.arrays.get(name, []) + words if append else words
            return
        try:
            words = shlex.split(self.substitute(value.replace("\\\n", ""), assigned=True), comments=True)
        except ValueError:
            return
        if not append and len(words) <= 1:  # NAME=value or NAME= (set, empty); NAME=value command: the command's
            self.scalars[name] = words[0] if words else ""

    def substitute(self, text: str, assigned: bool = False) -> str:
        return _substitute(text, self.scalars, self.arrays, self.defaults, assigned=assigned)

    def test(self, text: str) -> bool | None:
        """Whether the test command ``text`` succeeds, as bash evaluates it over the file's values;
        None where it depends on what the file does not set or is not one dsauto evaluates."""
        words = _WORD.findall(text)
        negated = bool(words) and words[0] == "!"
        words = words[negated:]
        if len(words) >= 2 and words[0] == "[[" and words[-1] == "]]":
            inner, extended = words[1:-1], True
        elif len(words) >= 2 and words[0] == "[" and words[-1] == "]":
            inner, extended = words[1:-1], False
        elif words and words[0] == "test":
            inner, extended = words[1:], False
        else:
            return None
        ors, ands = ("||", "-o") if not extended else ("||",), ("&&", "-a") if not extended else ("&&",)
        result: bool | None = False
        for group in _split(inner, ors):
            value: bool | None = True
            for clause in _split(group, ands):
                value = _both(value, self.clause(clause, extended))
            result = _either(result, value)
        return _not(result) if negated else result

    def clause(self, words: list[str], extended: bool) -> bool | None:
        """One comparison of a test (:meth:`test`); None where it is not one dsauto evaluates."""
        negated = bool(words) and words[0] == "!"
        words = words[negated:]
        values = [self.value(word) for word in words]
        if any(value is None for value in values) or not 1 <= len(words) <= 3:
            return None
        value: bool | None = None
        if len(words) == 1:
            value = values[0] != ""
        elif len(words) == 2 and words[0] in ("-z", "-n"):
            value = (values[1] == "") == (words[0] == "-z")
        elif len(words) == 3:
            left, operator, right = values[0], words[1], values[2]
            pattern = extended and not any(q in words[2] for q in "'\"")  # unquoted: a pattern in [[ ]]
            if operator in ("=", "==", "!="):
                matches = fnmatch.fnmatchcase(left, right) if pattern else left == right
                value = matches if operator != "!=" else not matches
            elif operator == "=~" and extended:
                try:
                    value = re.search(right if pattern else re.escape(right), left) is not None
                except re.error:
                    value = None
            elif operator in ("<", ">") and extended:
                value = left < right if operator == "<" else left > right
            elif operator in _INTEGER_COMPARISONS and all(_INTEGER.fullmatch(v) for v in (left, right)):
                value = _INTEGER_COMPARISONS[operator](int(left), int(right))
        return None if value is None else value != negated

    def value(self, word: str) -> str | None:
        """A test word's value (quotes removed, the file's values substituted), or None where it holds
        what the file does not set."""
        expanded = self.substitute(word, assigned=True)
        try:
            parts = shlex.split(expanded)
        except ValueError:
            return None
        value = " ".join(parts)
        return None if "$" in value else value


_INTEGER_COMPARISONS = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__,
                        "-gt": int.__gt__, "-ge": int.__ge__}


def _split(words: list[str], separators: tuple[str, ...]) -> list[list[str]]:
    """``words`` cut at each of ``separators``."""
    groups: list[list[str]] = [[]]
    for word in words:
        if word in separators:
            groups.append([])
        else:
            groups[-1].append(word)
    return groups


def _either(a: bool | None, b: bool | None) -> bool | None:
    """Three-valued or (None: cannot tell)."""
    return True if True in (a, b) else None if None in (a, b) else False


def _both(a: bool | None, b: bool | None) -> bool | None:
    """Three-valued and (None: cannot tell)."""
    return False if False in (a, b) else None if None in (a, b) else True


def _not(a: bool | None) -> bool | None:
    return None if a is None else not a


def _logical_line_end(text: str, pos: int) -> int:
    """Where the logical line starting at ``pos`` ends (past its newline): at the first newline
    outside quotes, parentheses (an array's words) and comments that no backslash continues."""
    depth, word_start = 0, True
    while pos < len(text):
        c = text[pos]
        if c == "\\":
            pos, word_start = pos + 2, False
            continue
        if c == "'" or c == '"':
            pos, word_start = _quote_end(text, pos), False
            continue
        if c == "#" and word_start:
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "\n" and depth == 0:
            return pos + 1
        word_start = c.isspace() or c in ";&|()"
        pos += 1
    return len(text)


def _quote_end(text: str, pos: int) -> int:
    """Past the quote that closes the one at ``pos`` (a backslash escapes inside double quotes)."""
    quote, pos = text[pos], pos + 1
    while pos < len(text) and text[pos] != quote:
        pos += 2 if quote == '"' and text[pos] == "\\" else 1
    return min(pos + 1, len(text))


def _quoted_at(line: str, index: int) -> bool:
    """Whether ``index`` of ``line`` stands inside quotes."""
    pos = 0
    while pos < index:
        if line[pos] in "'\"":
            end = _quote_end(line, pos)
            if end > index:
                return True
            pos = end
            continue
        pos += 2 if line[pos] == "\\" else 1
    return False


def _statements(line: str) -> list[tuple[str, str]]:
    """The commands of a logical line and what links each to the one before (``''``, ``;``, ``&&``,
    ``||``): cut at those outside quotes, parentheses and ``[[ ... ]]``; comments dropped."""
    out: list[tuple[str, str]] = []
    link, start, pos, depth, word_start, extended = "", 0, 0, 0, True, False
    def cut(end: int, next_link: str, skip: int) -> None:
        nonlocal link, start, pos
        if line[start:end].strip():
            out.append((link, line[start:end].strip()))
        link, start, pos = next_link, end + skip, end + skip

    while pos < len(line):
        c = line[pos]
        if c == "\\":
            pos, word_start = pos + 2, False
            continue
        if c in "'\"":
            pos, word_start = _quote_end(line, pos), False
            continue
        if c == "#" and word_start:
            end = line.find("\n", pos)
            end = len(line) if end < 0 else end
            line = line[:pos] + line[end:]
            continue
        if word_start and line.startswith("[[", pos) and line[pos + 2:pos + 3] in (" ", "\t"):
            extended = True
        elif word_start and extended and line.startswith("]]", pos):
            extended = False
        if c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and not extended:
            two = line[pos:pos + 2]
            if two in ("&&", "||"):
                cut(pos, two, 2)
                word_start = True
                continue
            if two == ";;" or c in ";\n":
                cut(pos, ";", 2 if two == ";;" else 1)
                word_start = True
                continue
        word_start = c.isspace() or c in ";&|()"
        pos += 1
    cut(len(line), "", 0)
    return out


def _closing_parenthesis(text: str, pos: int) -> int:
    """Where the ``)`` that closes an array opened just before ``pos`` stands: quotes, escapes,
    comments and nested parentheses (``$(hostname)``) skipped, as bash reads them."""
    return _closing(text, pos, "(", ")", comments=True)


def _closing(text: str, pos: int, opening: str, closing: str, comments: bool) -> int:
    """Where the ``closing`` character that matches an ``opening`` before ``pos`` stands, nested
    openings counted; escapes, quoted text and (``comments``) comments skipped."""
    depth, word_start = 0, True
    while pos < len(text):
        if text.startswith(opening, pos):
            depth, pos, word_start = depth + 1, pos + len(opening), False
            continue
        c = text[pos]
        if c == "\\":
            pos += 2
            continue
        if c in "'\"":
            pos, word_start = _quote_end(text, pos), False
            continue
        if comments and c == "#" and word_start:
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
            continue
        if c == closing:
            if depth == 0:
                return pos
            depth -= 1
        word_start = c.isspace()
        pos += 1
    return len(text)


def _substitute(text: str, scalars: dict[str, str], arrays: dict[str, list[str]], defaults: dict[str, str],
                double: bool = False, assigned: bool = False) -> str:
    """``text`` with the references to ``arrays`` and ``scalars`` replaced by their values: outside
    double quotes split into words at their blanks, as bash splits an unquoted expansion, each word
    quoted; inside them as they are; not at all inside single quotes or a comment. Defaults and
    arithmetic as :func:`expand_shell_variables` says. ``double``: ``text`` starts inside double
    quotes (a default's word within a quoted ``"${NAME:-...}"``); ``assigned``: ``text`` is the value
    of an assignment, which bash does not split."""
    def quoted_array(found: re.Match[str]) -> str:  # "${NAME[@]}": each element a word of its own
        name = found.group(1)[2:].partition("[")[0]
        return shlex.join(arrays[name]) if name in arrays else found.group(1)

    text = _QUOTED_ARRAY.sub(quoted_array, text)
    split = not double and not assigned
    out, pos, word_start = [], 0, True
    while pos < len(text):
        c = text[pos]
        if c == "'" and not double:
            end = text.find("'", pos + 1)
            end = len(text) if end < 0 else end + 1
            out.append(text[pos:end])
            pos, word_start = end, False
            continue
        if c == "#" and word_start and not double:
            end = text.find("\n", pos)
            end = len(text) if end < 0 else end
            out.append(text[pos:end])
            pos = end
            continue
        if c == "\\":
            out.append(text[pos:pos + 2])
            pos += 2
            word_start = False
            continue
        if text.startswith("$((", pos):
            close = _closing_parenthesis(text, pos + 3)
            if text.startswith(")", close + 1):
                value = _arithmetic(_substitute(text[pos + 3:close], scalars, arrays, defaults), scalars)
                written = text[pos:close + 2]  # kept one word, as bash's expansion would be
                out.append(value if value is not None else written if double else shlex.quote(written))
                pos, word_start = close + 2, False
                continue
        defaulted = _DEFAULTED.match(text, pos) if c == "$" else None
        if defaulted:
            name, colon, operator = defaulted.groups()
            close = _closing_brace(text, defaulted.end())
            if name in scalars and not (colon and scalars[name] == ""):  # ':' also defaults an empty value
                value = scalars[name]
                out.append(_as_words(value, double) if split else _as_word(value, double))
            else:
                word = text[defaulted.end():close]
                if double:  # inside "...": the default's own quotes are removed, its spaces kept
                    value = _substitute(word.replace('"', ""), scalars, arrays, defaults, True)
                    written = _as_word(value, True)
                else:
                    written = _substitute(word, scalars, arrays, defaults)
                    try:
                        value = " ".join(shlex.split(written))  # the default's words, quotes removed
                    except ValueError:
                        value = written
                if name not in scalars:  # the file's own empty value is not the job's to set
                    defaults[name] = value
                if operator == "=":  # ${NAME:=default} also sets NAME
                    scalars[name] = value
                out.append(written)
            pos, word_start = close + 1, False
            continue
        match = _REFERENCE.match(text, pos) if c == "$" else None
        if match:
            array, braced, bare = match.groups()
            if array is not None and array in arrays:
                out.append(" ".join(arrays[array]) if double else _as_words(" ".join(arrays[array]), False))
            elif array is None and (braced or bare) in scalars:
                value = scalars[braced or bare]
                out.append(_as_words(value, double) if split else _as_word(value, double))
            else:
                out.append(match.group(0))
            pos, word_start = match.end(), False
            continue
        if c == '"':
            double = not double
        out.append(c)
        word_start = c.isspace()
        pos += 1
    return "".join(out)


def _as_words(value: str, double: bool) -> str:
    """``value`` unquoted, split at its blanks into words as bash splits an expansion, each quoted
    (nothing, for an empty value); inside double quotes as :func:`_as_word`."""
    return _as_word(value, True) if double else shlex.join(value.split())


def _as_word(value: str, double: bool) -> str:
    """``value`` written to stay one word: escaped inside double quotes, quoted outside them."""
    return value.replace("\\", "\\\\").replace('"', '\\"') if double else shlex.quote(value)


def _closing_brace(text: str, pos: int) -> int:
    """Where the ``}`` that closes a ``${`` opened before ``pos`` stands: nested ``${...}`` counted,
    escapes and quoted text skipped, as bash reads a default's word."""
    return _closing(text, pos, "${", "}", comments=False)


def _arithmetic(expression: str, scalars: dict[str, str]) -> str | None:
    """The value of bash's integer arithmetic ``expression`` (``+ - * / %`` and parentheses over
    numbers and the file's whole-number variables, named bare or with ``$``), or None for anything
    else (a variable the file does not set or sets to other text, which bash would read from the job
    or evaluate, and ``**``, whose precedence under a unary minus is not Python's)."""
    def value(match: re.Match[str]) -> str:
        held = scalars.get(match.group(0), "")
        return f"({held})" if _INTEGER.fullmatch(held) else match.group(0)

    names = re.sub(r"[A-Za-z_]\w*", value, expression)
    if not _ARITHMETIC.fullmatch(names):
        return None
    try:
        tree = ast.parse(names.strip(), mode="eval")
        return str(_integer_value(tree.body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _integer_value(node: ast.AST) -> int:
    """An integer expression evaluated as bash does: ``/`` and ``%`` truncate towards zero."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _integer_value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _integer_value(node.left), _integer_value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, (ast.Div, ast.Mod)):
            quotient = abs(left) // abs(right) * (1 if (left < 0) == (right < 0) else -1)
            return quotient if isinstance(node.op, ast.Div) else left - right * quotient
    raise ValueError("not integer arithmetic")


