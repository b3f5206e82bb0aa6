"""MkDocs hooks (``hooks:`` in mkdocs.yml): files from outside docs/ shown in the site, never copied into it.

- A docs page may include a Markdown file of the repository with a line of its own of the form
  ``[any text](../README.md) <!-- include -->``: on GitHub that line is a link to the file, in the site
  it is replaced by the file's text (its leading ``# title`` dropped: the page has its own). So the README
  and examples/megatron/README.md stay the one source of their text.
- Relative links (a page's own and an included file's) are written as on GitHub, from the file they are in,
  and rewritten for the site: links to a file under docs/
  (or to an included file: to the page that includes it) become links between pages, images under
  benchmarks/results/ stay images, links to any other file of the repository become its path in code
  (the site holds no source files).
- Every PNG under benchmarks/results/ is added to the site at the same path, so the plots of the README and
  of docs/benchmarks/ (``benchmarks/results/cluster_race.png``) resolve in the site as they do on GitHub.
"""

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PLOTS = "benchmarks/results"
INCLUDE = re.compile(r"^\[[^\]\n]*\]\(([^)\s]+)\) <!-- include -->$", re.M)
LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
included = {}  # repository path of an included file -> repository path of the page that includes it


def on_files(files, config):
    included.clear()
    docs = Path(config["docs_dir"])
    for page in sorted(docs.rglob("*.md")):
        page_repo = page.relative_to(ROOT).as_posix()
        for target in INCLUDE.findall(page.read_text()):
            included[posixpath.normpath(posixpath.join(posixpath.dirname(page_repo), target))] = page_repo
    for png in sorted((ROOT / PLOTS).rglob("*.png")):
        files.append(File(png.relative_to(ROOT).as_posix(), src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    page_repo = (Path(config["docs_dir"]) / page.file.src_path).relative_to(ROOT).as_posix()
    if not page_repo.startswith("docs/"):
        return markdown  # a page added from elsewhere: already rewritten
    sources = []

    def hold(match):  # the include lines wait while the page's own links are rewritten
        sources.append(posixpath.normpath(posixpath.join(posixpath.dirname(page_repo), match.group(1))))
        return f"\0include{len(sources) - 1}\0"

    markdown = rewrite_links(INCLUDE.sub(hold, markdown), page_repo, page_repo)
    for i, source in enumerate(sources):
        text = re.sub(r"\A# [^\n]*\n", "", (ROOT / source).read_text())
        markdown = markdown.replace(f"\0include{i}\0", rewrite_links(text, source, page_repo))
    return markdown


def rewrite_links(text, source, page_repo):
    """The relative links of ``source`` (a repository path) as seen from the page ``page_repo``."""
    source_dir, page_dir = posixpath.dirname(source), posixpath.dirname(page_repo)

    def fix(match):
        bang, label, target = match.groups()
        if target.startswith("#") or re.match(r"^[a-zA-Z][a-zA-Z+.-]*:", target):
            return match.group(0)  # an anchor on the same page, or a URL
        path, _, anchor = target.partition("#")
        repo = included.get(posixpath.normpath(posixpath.join(source_dir, path)),
                            posixpath.normpath(posixpath.join(source_dir, path)))
        if repo.startswith("docs/") or repo.startswith(PLOTS + "/"):
            site_path = repo[len("docs/"):] if repo.startswith("docs/") else repo
            docs_page_dir = page_dir[len("docs"):].lstrip("/") or "."
            new = posixpath.relpath(site_path, docs_page_dir) + ("#" + anchor if anchor else "")
            return f"{bang}[{label}]({new})"
        return f"`{repo}`" if label.strip("`") == repo or label.strip("`") == path else f"{label} (`{repo}`)"

    return LINK.sub(fix, text)
