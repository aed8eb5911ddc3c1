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

_ASSIGNMENT = re.compile(r"(?:export[ \t]+|declare[ \t]+-[aAgix]+[ \t]+|local[ \t]+|readonly[ \t]+)?"
                         r"([A-Za-z_]\w*)(\+?)=")
_ELEMENT = re.compile(r"([A-Za-z_]\w*)\[([^]\s]*)\](\+?)=")  # ARRAY[i]=value
_QUOTED_ARRAY = re.compile(r"\"(\$\{[A-Za-z_]\w*\[@\]\})\"")  # "${NAME[@]}"; "${NAME[*]}" is one word
_REFERENCE = re.compile(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}|\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")
_DEFAULTED = re.compile(r"\$\{([A-Za-z_]\w*|\d+)(:?)([-=])")  # a positional argument's too: ${1:-default}
_ARITHMETIC = re.compile(r"[\d\s+\-*/%()]+")
_INTEGER = re.compile(r"-?\d+")
_HEREDOC = re.compile(r"(?<![<$(])<<-?\s*(['\"]?)([A-Za-z_]\w*)\1")  # not <<<, nor $(( 1 << N ))
_WORD = re.compile(r"""(?:[^\s'"\\]|\\.|'[^']*'|"(?:[^"\\]|\\.)*")+""", re.DOTALL)
_SEGMENT = re.compile(r"""'([^']*)'|"((?:[^"\\]|\\.)*)"|((?:[^'"\\]|\\.)+)""", re.DOTALL)
_CASE_ARM = re.compile(r"\(?\s*[^()\s|]+(?:\s*\|\s*[^()\s|]+)*\s*\)\s*")
_FUNCTION = re.compile(r"(?:function\s+([A-Za-z_][\w-]*)\s*(?:\(\))?|([A-Za-z_][\w-]*)\s*\(\))\s*(\{)?\s*")
_ARITHMETIC_ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)\s*(?:([-+*/%]?)=(?!=)\s*(.+)|(\+\+|--))$|(\+\+|--)([A-Za-z_]\w*)$")
_LOOPS = ("for", "while", "until", "select")
_CLOSERS = {"fi": "if", "esac": "case", "done": "loop"}
_OPERATORS = {"|", "||", "&", "&&", ";", ";;"}
"""Words that end a command."""


def is_assignment(word: str) -> bool:
    """Whether a command word is a variable assignment (``NAME=value``), not a command."""
    return bool(_ASSIGNMENT.match(word))


def split_words(text: str) -> list[str]:
    """``text``'s words as bash splits a command: ``\\`` line continuations joined, quotes removed,
    ``#`` comments only where a word starts (``run#3`` is one word, which shlex's own comments would
    cut)."""
    return shlex.split(_strip_comments(text.replace("\\\n", " ")))


def ends_command(word: str) -> bool:
    """Whether a word of a split command line ends the command: a list operator or a redirection
    (``|``, ``&&``, ``;``, ``2>&1``, ``> log``)."""
    return word in _OPERATORS or bool(re.fullmatch(r"\d*(?:>>?|<|>&\d*|&>>?)\S*", word))


def expand_shell_variables(text: str, defaults: dict[str, str] | None = None,
                           unevaluated: dict[str, str] | None = None, job: dict[str, str] | None = None) -> str:
    """``text`` with the bash arrays it defines (``NAME=( ... )``, ``NAME+=( ... )``, ``NAME[i]=...``)
    taken out and each ``${NAME[@]}`` replaced by their words, and each ``$NAME`` / ``${NAME}`` of a
    variable it sets to one value (``NAME=value``, ``export NAME=value``, ``NAME+=more``, a quoted
    value over several lines too, ``(( NAME *= 2 ))``) replaced by that value, as Megatron-LM's
    example launch scripts build their command (``torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py
    ${GPT_MODEL_ARGS[@]} ...``): unquoted, an element or a value splits into words at its blanks, as
    bash splits it, quoted it stays one word (each element one word in ``"${NAME[@]}"``, all of them
    one in ``"${NAME[*]}"``). A variable set outside the file (``$1``, ``$NNODES`` from the job) or
    by a command (``$(nproc)``) stays as written, and nothing inside single quotes, a comment or a
    here-document is expanded.

    Branches run as bash runs them where the file decides them: ``if``/``elif``/``else``/``fi``
    (conditions joined by ``&&`` and ``||``, one-line ones and commands after ``then``/``else``
    too), ``case`` arms over the file's values, and ``TEST && command`` / ``TEST || command``, over
    tests of the file's own values (``[[ ... ]]``, ``[ ... ]``, ``test``: string comparisons,
    patterns and ``=~`` in ``[[ ]]`` for their unquoted parts, integer comparisons, ``-z``, ``-n``,
    ``!``, ``&&`` binding tighter than ``||``); an ``exit`` the file reaches ends it. A branch the
    file cannot decide (a test over what the job sets, a file test, a command), the bodies of loops
    and functions (bash runs these where they are called), ``source`` and ``eval`` set nothing:
    each variable they would set is added to ``unevaluated`` with the reason, for the caller to say
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
        if heredoc is not None:  # a here-document's lines are input, not commands: read line by line
            end = text.find("\n", pos)
            end = len(text) if end < 0 else end + 1
            heredoc = None if text[pos:end].strip() == heredoc else heredoc
            pos = end
            continue
        end = _logical_line_end(text, pos)
        line, pos = text[pos:end], end
        found = _HEREDOC.search(line) if "<<" in line and not line.lstrip().startswith("#") else None
        # a here-document opens where the operator stands outside quotes and arithmetic ($(( 1 << N )))
        # and its body is still to come (inside $( ... ) the logical line holds it whole)
        heredoc = found.group(2) if found and not _quoted_at(line, found.start()) and (
            line.count("$((", 0, found.start()) <= line.count("))", 0, found.start())) and not re.search(
            rf"\n\s*{re.escape(found.group(2))}\s*\n", line[found.end():]) else None
        out.append(shell.run(line))
    return "".join(out)


@dataclass
class _Block:
    """An open compound command of a launch script: an ``if`` block, a ``case``, a loop or a function."""

    kind: str
    """``if``, ``case``, ``loop`` or ``function``."""
    test: str
    """What decides it, as written (for the report of what it would set)."""
    parent: bool | None
    """Whether the commands around the block run (three-valued: None where the file cannot tell)."""
    own: bool | None
    """Whether its branch being read runs, given its surroundings do."""
    taken: bool | None = False
    """``if`` and ``case``: whether an earlier branch of the block ran."""
    value: str | None = None
    """``case``: the word its arms match, None where the file does not set it."""

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
        self.stopped = False  # an exit the file reached

    def runs(self) -> bool | None:
        """Whether the command being read runs: True, False, or None where the file cannot tell."""
        return self.blocks[-1].runs if self.blocks else True

    def why(self) -> str:
        """Why the command being read may or may not run: the outermost block the file cannot decide."""
        return next((b.test for b in self.blocks if b.own is None), "a list over a command's status")

    def report(self, name: str, why: str | None = None) -> None:
        self.unevaluated.setdefault(name, why or self.why())

    def run(self, line: str) -> str:
        """The logical line ``line`` as the text to read words from: the commands that run (or may),
        expanded; the variables and blocks it sets kept for the lines after it. A whole-line comment
        is kept as written (dsauto's own file states its launch environment in one)."""
        newline = "\n" if line.endswith("\n") else ""
        if self.stopped:
            return newline
        if line.lstrip().startswith("#"):
            return line
        outputs, status = [], True
        statements = _statements(line)
        i = 0
        while i < len(statements):
            link, statement = statements[i]
            first = statement.split(None, 1)[0]
            if first in ("if", "elif", "while", "until"):
                # the condition: this command and those joined to it by && and ||, up to 'then' / 'do'
                j = i + 1
                while j < len(statements) and statements[j][0] in ("&&", "||"):
                    j += 1
                self.compound(first, statement[len(first):].strip(), statements[i + 1:j])
                i, status = j, True
                continue
            here = self.runs()
            if link == "&&":
                here = _both(here, status)
            elif link == "||":
                here = _both(here, _not(status))
            i += 1
            if here is False and link in ("&&", "||"):
                continue  # skipped: the list's status stays that of the command before
            status, written = self.statement(statement, here)
            if written:
                outputs.append(written)
            if self.stopped:
                break
        return " ; ".join(outputs) + newline

    def condition(self, first: str, rest: list[tuple[str, str]]) -> bool | None:
        """Whether a condition list succeeds: its commands left to right, each joined to the status
        before by ``&&`` or ``||``."""
        value = self.test(first)
        for link, text in rest:
            if (link == "&&" and value is False) or (link == "||" and value is True):
                continue  # not run
            value = _both(value, self.test(text)) if link == "&&" else _either(value, self.test(text))
        return value

    def compound(self, keyword: str, test: str, rest: list[tuple[str, str]]) -> None:
        """Opens an ``if`` block or a loop, or moves an ``if`` block to its ``elif`` branch."""
        written = " ".join([test, *(f"{link} {text}" for link, text in rest)])
        parent = self.runs()
        if keyword == "if":
            self.blocks.append(_Block("if", written, parent, self.condition(test, rest) if parent is True else
                                      _undecided(parent)))
            return
        if keyword in ("while", "until"):
            self.blocks.append(_Block("loop", f"{keyword} {written}", parent, _undecided(parent)))
            return
        block = self.blocks[-1] if self.blocks else None
        if block is None or block.kind != "if":
            return
        block.taken = _either(block.taken, block.own)
        decided = self.condition(test, rest) if block.parent is True and block.taken is not True else None
        block.own = False if block.taken is True else decided if block.taken is False else (
            False if decided is False else None)
        block.test = written

    def statement(self, text: str, here: bool | None) -> tuple[bool | None, str]:
        """(exit status, text to keep) of one simple or compound-command word list ``text``, which runs
        as ``here`` says."""
        first, rest = (text.split(None, 1) + [""])[:2] if text.strip() else ("", "")
        rest = rest.strip()
        block = self.blocks[-1] if self.blocks else None
        if first in ("then", "do", "{"):
            return self.statement(rest, self.runs() if first != "{" else here) if rest else (True, "")
        if first == "}":
            if block is not None and block.kind == "function":
                self.blocks.pop()
            return True, ""
        if first == "else" and block is not None and block.kind == "if":
            block.taken = _either(block.taken, block.own)
            block.own = _not(block.taken)
            return self.statement(rest, self.runs()) if rest else (True, "")
        if first in _CLOSERS:
            if block is not None and block.kind == _CLOSERS[first]:
                self.blocks.pop()
            return True, ""
        if first in _LOOPS:  # a loop's body runs as many times as the file cannot count
            self.blocks.append(_Block("loop", text.removesuffix("; do"), self.runs(), _undecided(self.runs())))
            return None, ""
        if first == "case":
            word, _, arms = rest.partition(" in")
            parent = self.runs()
            self.blocks.append(_Block("case", f"case {word.strip()} in", parent, False,
                                      value=self.value(word.strip()) if parent is True else None))
            return self.statement(arms.strip(), here) if arms.strip() else (True, "")
        if block is not None and block.kind == "case" and (arm := _CASE_ARM.match(text)):
            patterns = [p.strip() for p in text[:arm.end()].strip().strip("()").split("|")]
            if block.parent is False or block.taken is True:
                block.own = False
            elif block.value is None or block.parent is None:
                block.own, block.taken = None, _either(block.taken, None)
            else:
                block.own = any(fnmatch.fnmatchcase(block.value, self.value(p) or p) for p in patterns)
                block.taken = block.own
            remainder = text[arm.end():].strip()
            return self.statement(remainder, self.runs()) if remainder else (True, "")
        if function := _FUNCTION.match(text):
            name = function.group(1) or function.group(2)
            self.blocks.append(_Block("function", f"the function {name}, which bash runs where it is called",
                                      self.runs(), _undecided(self.runs())))
            remainder = text[function.end():].strip()
            return self.statement(remainder, self.runs()) if remainder else (True, "")
        if here is False or not text:
            return None, ""
        if first in ("source", ".", "eval"):
            self.report(f"`{text}`", "a file or string dsauto does not read")
            return None, ""
        if first == "exit" and here is True and not any(b.kind == "function" for b in self.blocks):
            self.stopped = True
            return None, ""
        if first == "unset":
            for name in rest.split():
                if here is True:  # unset by the file: empty where it stands, as bash expands it
                    self.arrays.pop(name, None)
                    self.scalars[name] = ""
                else:
                    self.report(name)
            return here, ""
        if first == "let" or text.startswith("(("):
            return self.arithmetic(text.removeprefix("let").strip().strip("()").strip(), here), ""
        # from here on the command runs (here True) or the file cannot tell (None), its status likewise
        if element := _ELEMENT.match(text):
            self.element(element, text, here)
            return here, ""
        match = _ASSIGNMENT.match(text)
        if match:
            self.assign(match, text, here)
            array = text.startswith("(", match.end())  # its words live on in the array, not here
            return here, self.substitute(text) if here is True and not array else ""
        if first in ("[[", "[", "test", "!"):
            return (self.test(text) if here is True else None), ""
        return None, self.substitute(text)

    def assign(self, match: re.Match[str], text: str, here: bool | None) -> None:
        """Sets the variable or array of the assignment ``text`` where it runs; where the file cannot
        tell, reports it."""
        name, append = match.group(1), match.group(2)
        if here is not True:
            if here is None:
                self.report(name)
            return
        value = text[match.end():]
        if value.startswith("("):
            close = _closing_parenthesis(value, 1)
            words = split_words(self.substitute(value[1:close]))
            before = self.arrays.get(name, [self.scalars[name]] if name in self.scalars else [])
            self.arrays[name] = before + words if append else words
            self.scalars.pop(name, None)
            return
        word = value[:_word_end(value, 0)]
        if re.search(r"\$\((?!\()|`", word):  # a command's output: not the file's to tell
            self.scalars.pop(name, None)
            return
        try:
            words = split_words(self.substitute(word.replace("\\\n", ""), assigned=True))
        except ValueError:
            return
        joined = words[0] if words else ""
        if value[len(word):].strip() and not value[len(word):].lstrip().startswith("#"):
            return  # NAME=value command: the command's environment, not the file's variable
        if append and name in self.arrays:  # NAME+=more on an array appends to its first element
            values = self.arrays[name] or [""]
            self.arrays[name] = [values[0] + joined] + values[1:]
        else:
            self.scalars[name] = self.scalars.get(name, "") + joined if append else joined

    def element(self, match: re.Match[str], text: str, here: bool | None) -> None:
        """Sets one element of an array (``NAME[i]=value``) where it runs and its index is a number."""
        name, index = match.group(1), _arithmetic(self.substitute(match.group(2)), self.scalars)
        if here is not True or index is None or name not in self.arrays:
            if here is not False:
                self.report(name, None if here is None else "an element dsauto cannot place")
            return
        word = text[match.end():]
        words = split_words(self.substitute(word[:_word_end(word, 0)], assigned=True))
        values, i = self.arrays[name], int(index)
        if 0 <= i < len(values) + 1:
            value = (values[i] if i < len(values) and match.group(3) else "") + (words[0] if words else "")
            self.arrays[name] = values[:i] + [value] + values[i + 1:]
        else:
            self.report(name, "an element past the array's end")

    def arithmetic(self, expression: str, here: bool | None) -> bool | None:
        """Runs an arithmetic command (``(( N *= 2 ))``, ``let N=N+1``): its assignment where the file
        gives its values, reported where not; a comparison is a status dsauto does not decide."""
        found = _ARITHMETIC_ASSIGNMENT.match(expression.strip())
        if not found:
            return None
        name = found.group(1) or found.group(6)
        if here is not True:
            if here is None:
                self.report(name)
            return None
        step = found.group(4) or found.group(5)
        operator, operand = (step[0], "1") if step else (found.group(2), found.group(3))
        value = _arithmetic(f"{name} {operator} ({operand})" if operator else operand, self.scalars)
        if value is None:
            self.scalars.pop(name, None)
            self.report(name, f"(( {expression} ))")
            return None
        self.scalars[name] = value
        return value != "0"

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
        elif words in (["true"], [":"]):
            return not negated
        elif words == ["false"]:
            return negated
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
        """One comparison of a test (:meth:`test`); None where it is not one dsauto evaluates. In
        ``[ ]`` an unquoted value splits at its blanks, and an empty one is no word, as bash splits
        them; in ``[[ ]]`` the right side of ``==``, ``!=`` and ``=~`` matches as a pattern where unquoted."""
        negated = bool(words) and words[0] == "!"
        words = words[negated:]
        operators = ("=", "==", "!=", "=~", "<", ">", *_INTEGER_COMPARISONS)
        values: list[str | None] = []
        kept: list[str] = []
        for word in words:
            value = self.value(word)
            if not extended and value is not None and not any(q in word for q in "'\"") and word not in operators:
                values += value.split()  # [ ] splits an unquoted value; an empty one vanishes
                kept += [word] * len(value.split())
            else:
                values.append(value)
                kept.append(word)
        if any(value is None for value in values) or not 1 <= len(values) <= 3:
            return None
        value: bool | None = None
        if len(values) == 1:
            value = values[0] != ""
        elif len(values) == 2 and kept[0] in ("-z", "-n"):
            value = (values[1] == "") == (kept[0] == "-z")
        elif len(values) == 3:
            left, operator, right = values[0], kept[1], values[2]
            if operator in ("=", "==", "!="):
                matches = fnmatch.fnmatchcase(left, self.pattern(kept[2])) if extended else left == right
                value = matches if operator != "!=" else not matches
            elif operator == "=~" and extended:
                try:
                    value = re.search(self.pattern(kept[2], regex=True), left) is not None
                except re.error:
                    value = None
            elif operator in ("<", ">") and extended:
                value = left < right if operator == "<" else left > right
            elif operator in _INTEGER_COMPARISONS and all(_INTEGER.fullmatch(v) for v in (left, right)):
                value = _INTEGER_COMPARISONS[operator](int(left), int(right))
        return None if value is None else value != negated

    def pattern(self, word: str, regex: bool = False) -> str:
        """A test word as a pattern: its unquoted parts with their glob (or regex) characters, its
        quoted parts literal, the file's values substituted."""
        parts = []
        for single, double, bare in _SEGMENT.findall(word):
            if bare:
                parts.append(self.value(bare) or "")
            else:
                literal = single if single else (self.value(f'"{double}"') or "")
                parts.append(re.escape(literal) if regex else re.sub(r"([*?\[])", r"[\1]", literal))
        return "".join(parts)

    def value(self, word: str) -> str | None:
        """A test word's value (quotes removed, the file's values substituted), or None where it holds
        what the file does not set."""
        expanded = self.substitute(word, assigned=True)
        try:
            parts = shlex.split(expanded)
        except ValueError:
            return None
        value = " ".join(parts)
        return None if "$" in value or "`" in value else value


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


def _undecided(parent: bool | None) -> bool | None:
    """What the file can tell of a branch it does not decide under ``parent``: it does not run where
    its surroundings do not, and may otherwise."""
    return False if parent is False else None


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
    line = _strip_comments(line)
    out: list[tuple[str, str]] = []
    link, start, pos, depth, word_start, extended = "", 0, 0, 0, True, False

    def cut(end: int, next_link: str, skip: int) -> None:
        nonlocal link, start, pos
        if line[start:end].strip():
            out.append((link, line[start:end].strip().removeprefix("\\\n").strip()))
        link, start, pos = next_link, end + skip, end + skip

    while pos < len(line):
        c = line[pos]
        if c == "\\":
            pos, word_start = pos + 2, False
            continue
        if c in "'\"":
            pos, word_start = _quote_end(line, pos), False
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


def _strip_comments(text: str) -> str:
    """``text`` without its comments: from a ``#`` that starts a word, outside quotes, to the end of
    its line, as bash reads them."""
    out, pos, word_start = [], 0, True
    while pos < len(text):
        c = text[pos]
        if c == "\\":
            out.append(text[pos:pos + 2])
            pos, word_start = pos + 2, False
            continue
        if c in "'\"":
            end = _quote_end(text, pos)
            out.append(text[pos:end])
            pos, word_start = end, False
            continue
        if c == "#" and word_start:
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
            continue
        out.append(c)
        word_start = c.isspace() or c in ";&|()"
        pos += 1
    return "".join(out)


def _word_end(text: str, pos: int) -> int:
    """Where the shell word starting at ``pos`` ends: at the first blank outside quotes, ``$(...)``,
    ``${...}`` and backquotes."""
    while pos < len(text) and not text[pos].isspace() and text[pos] not in ";&|":
        c = text[pos]
        if c == "\\":
            pos += 2
        elif c in "'\"":
            pos = _quote_end(text, pos)
        elif text.startswith("$(", pos):
            pos = _closing_parenthesis(text, pos + 2) + 1
        elif text.startswith("${", pos):
            pos = _closing_brace(text, pos + 2) + 1
        elif c == "`":
            end = text.find("`", pos + 1)
            pos = len(text) if end < 0 else end + 1
        else:
            pos += 1
    return min(pos, len(text))


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


