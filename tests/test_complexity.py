"""No function of the package is too branchy to read: cyclomatic complexity at most 20
(``python -m pflego.tools.complexity`` prints the worst)."""

from __future__ import annotations

import ast

from pflego.tools.complexity import LIMIT, complexity, functions, main


def test_no_function_is_above_the_limit():
    over = {name: score for name, score in functions() if score > LIMIT}
    assert not over, f"functions above complexity {LIMIT} (split them): {over}"


def test_the_counter_sees_every_kind_of_branch():
    source = (
        "def f(xs, y):\n"
        "    if y and xs or not y:\n"  # if, and, or: 3
        "        pass\n"
        "    elif y:\n"  # 1
        "        pass\n"
        "    for x in xs:\n"  # 1
        "        while x:\n"  # 1
        "            x -= 1\n"
        "    try:\n"
        "        pass\n"
        "    except ValueError:\n"  # 1
        "        pass\n"
        "    except KeyError:\n"  # 1
        "        pass\n"
        "    zs = [x for x in xs if x if y]\n"  # comprehension and two ifs: 3
        "    w = 1 if y else 2\n"  # 1
        "    match y:\n"
        "        case 1:\n"  # 1
        "            pass\n"
        "        case _:\n"  # 1
        "            pass\n"
        "    def g():\n"  # a nested function's branches count in its parent
        "        if y:\n"  # 1
        "            pass\n"
        "    return zs, w, g\n"
    )
    (function,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    assert complexity(function) == 1 + 3 + 1 + 1 + 1 + 2 + 3 + 1 + 2 + 1


def test_a_deliberately_complex_function_is_found(tmp_path, capsys):
    branches = "".join(f"    if x == {k}:\n        return {k}\n" for k in range(LIMIT))
    package = tmp_path / "pflego"
    package.mkdir()
    (package / "tangled.py").write_text(f"def tangled(x):\n{branches}    return x\n")
    (package / "plain.py").write_text("def plain(x):\n    return x\n")
    assert dict(functions(package)) == {
        "pflego/plain.py:plain": 1,
        "pflego/tangled.py:tangled": LIMIT + 1,
    }
    assert main([str(package), "--top", "1"]) == 1
    assert capsys.readouterr().out == f"{LIMIT + 1} pflego/tangled.py:tangled\n"
