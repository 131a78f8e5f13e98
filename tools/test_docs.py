"""Checks of the documentation site that need nothing but the standard library (issue #31 item 8).

The pages and ``mkdocs.yml`` are read as text: no mkdocs, no yaml. Each check guards one defect
that once shipped: a guide contradicting another, a component list missing packages, a Chinese
page missing code of its English page, absolute language-switch links.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGES = ROOT / "packages"
TEST_ONLY_PACKAGES = {"colossal-testkit"}


def _read(relative: str) -> str:
    return (DOCS / relative).read_text(encoding="utf-8")


def _sentences(text: str) -> list[str]:
    """Rough sentences (English and Chinese): enough to see which claims go together."""
    return [s for s in re.split(r"(?<=[.;:。；：])\s+|(?<=[。；])|\n\s*\n|\n\* ", text) if s.strip()]


# ---- 1. what a sharded ZeRO save holds ----------------------------------------------------------
# The truth, from the code: ZeroPlugin.checkpoint_pieces hands DCP engine.sharded_state_dict(),
# "views of its own slices, never a gathered tensor" (colossal.zero.checkpoint); only the exports
# (full_model_state_dict: an all-gather, then .cpu(), on every rank) hold the whole model.
SHARED_WORDING = {
    # language suffix -> (phrase both the ZeRO guide and the checkpoint guide use, the old claim)
    "": (
        ("own slices of the flat buffers", "allocates the whole model or optimizer state"),
        "full CPU copy while saving",
    ),
    ".zh": (("自己在扁平缓冲区中的切片", "不会分配完整的模型或优化器状态"), "检查点保存收集后的"),
}


@pytest.mark.parametrize("lang", sorted(SHARED_WORDING))
def test_booster_zero_sharded_save_writes_slices_like_the_checkpoint_guide(lang):
    zero, checkpoints = _read(f"guides/booster-zero{lang}.md"), _read(f"guides/checkpoints{lang}.md")
    flat = lambda text: " ".join(text.split())  # noqa: E731  (phrases may wrap)
    zero_flat, checkpoints = flat(zero), flat(checkpoints)
    phrases, old_claim = SHARED_WORDING[lang]
    assert old_claim not in zero_flat, f"booster-zero{lang}.md still says a sharded save gathers the whole state"
    for phrase in phrases:
        assert phrase in checkpoints, f"checkpoints{lang}.md no longer says {phrase!r}"
        assert phrase in zero_flat, f"booster-zero{lang}.md does not say what checkpoints{lang}.md says: {phrase!r}"
    # A full copy on every rank is true only of the exports: every sentence claiming one names one.
    full_copy = re.compile(r"full (fp32 )?(CPU )?(copy|state)|each rank holds a full|完整.{0,12}(副本|状态)")
    for sentence in _sentences(zero):
        if full_copy.search(sentence) and "allocates the whole" not in sentence and "不会分配" not in sentence:
            assert "export_safetensors" in sentence, f"booster-zero{lang}.md: a full copy outside exports: {sentence!r}"


# ---- 2. the component list ----------------------------------------------------------------------
def _user_packages() -> list[str]:
    dirs = sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file())
    assert dirs, f"no packages found under {PACKAGES}"
    return [d for d in dirs if d not in TEST_ONLY_PACKAGES]


def _distribution(package_dir: str) -> str:
    text = (PACKAGES / package_dir / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^name\s*=\s*"([^"]+)"', text, re.M)
    assert match, f"packages/{package_dir}/pyproject.toml has no name"
    return match.group(1)


@pytest.mark.parametrize("page", ["guides/getting-started.md", "guides/getting-started.zh.md"])
def test_getting_started_lists_every_user_package(page):
    text = _read(page)
    missing = [d for d in _user_packages() if not re.search(rf"(?<![\w-]){re.escape(d)}(?![\w-])", text)]
    assert not missing, f"{page} does not name {missing}"
    for d in _user_packages():
        assert f"../packages/{d}.md" in text, f"{page} does not link docs/packages/{d}.md"
        assert (DOCS / "packages" / f"{d}.md").is_file(), f"docs/packages/{d}.md does not exist"
        assert f"`{_distribution(d)}`" in text, f"{page} does not give {d}'s distribution name"


# ---- 3. the Chinese pages are full translations -------------------------------------------------
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
_COMMENT = re.compile(r"(^|\s)#(\s.*)?$")  # a full-line or trailing '# ...' comment (python, bash, trees)


def _code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(info string, lines)`` of every fenced code block, in order."""
    blocks, current, fence = [], None, ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if current is None:
            if match:
                fence, current = match.group(1), (match.group(2).strip(), [])
        elif match and match.group(1).startswith(fence) and not match.group(2).strip():
            blocks.append(current)
            current = None
        else:
            current[1].append(line)
    assert current is None, "an unclosed code fence"
    return blocks


def _code(line: str) -> tuple[str, bool]:
    """The line without its comment (comments may be translated), and whether it had one."""
    stripped = _COMMENT.sub("", line).rstrip()
    return stripped, stripped != line.rstrip()


def _pairs() -> list[tuple[pathlib.Path, pathlib.Path]]:
    pairs = []
    for en in sorted(DOCS.rglob("*.md")):
        zh = en.with_name(en.name.removesuffix(".md") + ".zh.md")
        if not en.name.endswith(".zh.md") and zh.is_file():
            pairs.append((en, zh))
    assert pairs, "no translated pages found"
    return pairs


@pytest.mark.parametrize("en,zh", _pairs(), ids=lambda p: str(p.relative_to(DOCS)))
def test_translation_has_the_same_code_and_sections(en, zh):
    en_text, zh_text = en.read_text(encoding="utf-8"), zh.read_text(encoding="utf-8")
    en_blocks, zh_blocks = _code_blocks(en_text), _code_blocks(zh_text)
    assert len(zh_blocks) == len(en_blocks), f"{zh.name}: {len(zh_blocks)} code blocks, {en.name}: {len(en_blocks)}"
    for i, ((en_info, en_lines), (zh_info, zh_lines)) in enumerate(zip(en_blocks, zh_blocks, strict=True)):
        where = f"{zh.name} code block {i + 1} ({en_lines[0] if en_lines else 'empty'!r})"
        assert zh_info == en_info, f"{where}: language {zh_info!r}, {en.name} has {en_info!r}"
        assert [_code(line) for line in zh_lines] == [_code(line) for line in en_lines], (
            f"{where} differs from {en.name} outside its comments"
        )
    count = lambda text: len(re.findall(r"^## ", "\n".join(_strip_code(text)), re.M))  # noqa: E731
    assert count(zh_text) == count(en_text), f"{zh.name}: {count(zh_text)} '## ' sections, {en.name}: {count(en_text)}"


def _strip_code(text: str) -> list[str]:
    out, inside, fence = [], False, ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if not inside and match:
            inside, fence = True, match.group(1)
        elif inside and match and match.group(1).startswith(fence) and not match.group(2).strip():
            inside = False
        elif not inside:
            out.append(line)
    return out


# ---- 4. language-switch links work under any sub-path -------------------------------------------
def _alternates(mkdocs_yml: str) -> list[dict[str, str]]:
    """The ``extra.alternate`` entries of mkdocs.yml (``- name/link/lang`` mappings), by hand."""
    lines = mkdocs_yml.splitlines()
    try:
        extra = next(i for i, line in enumerate(lines) if line.rstrip() == "extra:")
    except StopIteration:
        return []
    entries, inside = [], False
    for line in lines[extra + 1 :]:
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next top-level key
        if re.match(r"^\s+alternate:\s*$", line):
            inside = True
            continue
        if inside:
            item = re.match(r"^\s+(-\s+)?(\w+):\s*(.*?)\s*$", line)
            if not item:
                continue
            if re.match(r"^\s+\w+:\s*$", line) and not item.group(1):
                break  # the next key of extra
            if item.group(1):
                entries.append({})
            entries[-1][item.group(2)] = item.group(3).strip("'\"")
    return entries


def test_language_switch_links_are_relative():
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    languages = re.findall(r"^\s+- locale:\s*(\w+)", text, re.M)
    alternates = _alternates(text)
    # Without extra.alternate, mkdocs-static-i18n writes "/" and "/zh/" (absolute) for each home page.
    assert alternates, "mkdocs.yml sets no extra.alternate: the plugin's default links are absolute"
    assert sorted(a.get("lang") for a in alternates) == sorted(languages), "one alternate per built language"
    for a in alternates:
        link = a.get("link", "")
        assert link and not link.startswith("/") and "://" not in link, f"absolute language link {a}"
        assert link.endswith("/"), f"{a}: a link to the language's home folder ends with '/'"
    for line in text.splitlines():  # the plugin's own link options too
        assert not re.match(r"^\s+(fixed_)?link:\s*['\"]?/", line), f"absolute link in mkdocs.yml: {line.strip()}"
