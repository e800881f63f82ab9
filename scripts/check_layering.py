#!/usr/bin/env python3
"""Checks the dependency rules of the source tree (README "Layout"); exits 1 naming each breach.

1. The client deliverables -- rankclient/, slidedpctl/, examples/, python_client/ -- include,
   link or reference nothing of hostd/: they depend on proto/, common/, kernels/ and model/.
2. Product code (every file but tests) includes only folders below its own layer:
     proto < common < kernels, model < hostd, rankclient, slidedpctl < examples < bench, tests
   Folders of one layer never include each other. Tests (*_test.cc, test_util.h, fake_*) may also
   include their own layer's folders (a hostd test drives hostd as a rank would), but rule 1 holds.
3. No include cycle among modules (a .h/.cc pair and its x_internal.h are one node).

Usage: check_layering.py [ROOT]     (default: the repository holding this script)
       check_layering.py --self-test (a tree with one breach of each rule must fail on each)
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

CLIENTS = ("rankclient", "slidedpctl", "examples", "python_client")
LAYER = {
    "proto": 0, "common": 1, "kernels": 2, "model": 2,
    "hostd": 3, "rankclient": 3, "slidedpctl": 3, "python_client": 3,
    "examples": 4, "bench": 5, "tests": 5,
}
# Generated headers of proto/ are included as slidedp/v1/*.pb.h.
INCLUDE_ROOT = {"slidedp": "proto"}
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def list_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True, text=True)
        files = out.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, _, names in os.walk(root):
            for n in names:
                files.append(os.path.relpath(os.path.join(d, n), root))
    return sorted(f for f in files if os.path.isfile(os.path.join(root, f))
                  and not f.startswith(("third_party/", "build")))


def is_test(path):
    base = os.path.basename(path)
    return "_test" in base or base.startswith(("test_util", "fake_")) or "/testdata/" in path


def top(path):
    return INCLUDE_ROOT.get(path.split("/")[0], path.split("/")[0])


def module(path):
    # An internal header (x_internal.h, x_impl.h) belongs to the module it serves: x.cc may
    # include it and it may include x.h without forming a cycle.
    return re.sub(r"_(internal|impl)$", "", os.path.splitext(path)[0])


def check(root):
    errors = []
    files = list_files(root)
    sources = [f for f in files if f.endswith(SOURCE_EXT)]
    graph = collections.defaultdict(set)
    for f in sources:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        src = top(f)
        for inc in INCLUDE_RE.findall(text):
            dst = top(inc)
            if dst not in LAYER:
                continue  # a third-party header
            if os.path.exists(os.path.join(root, inc)):
                graph[module(f)].add(module(inc))
            if src in CLIENTS and dst == "hostd":
                errors.append(f"{f}: includes {inc}: {src}/ must not depend on hostd/")
                continue
            if src not in LAYER or src == dst:
                continue
            if LAYER[dst] > LAYER[src] or (LAYER[dst] == LAYER[src] and not is_test(f)):
                errors.append(f"{f}: includes {inc}: {src}/ (layer {LAYER[src]}) may not include "
                              f"{dst}/ (layer {LAYER[dst]})")

    # Rule 1 for the build: a client's CMake files name no target that hostd/ defines.
    hostd_targets = set()
    target_re = re.compile(r"\b(?:slidedp_library|slidedp_test|slidedp_gpu_test|add_library|"
                           r"add_executable)\(\s*([A-Za-z0-9_]+)")
    for f in files:
        if f.startswith("hostd/") and os.path.basename(f).startswith("CMakeLists"):
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                hostd_targets.update(target_re.findall(fh.read()))
    for f in files:
        if top(f) in CLIENTS and (os.path.basename(f) == "CMakeLists.txt" or f.endswith(".cmake")):
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                text = re.sub(r"#.*", "", fh.read())
            for t in sorted(hostd_targets):
                if re.search(r"(?<![A-Za-z0-9_])" + re.escape(t) + r"(?![A-Za-z0-9_])", text):
                    errors.append(f"{f}: links {t}, a target of hostd/")
            if re.search(r"\bhostd/", text):
                errors.append(f"{f}: names a path under hostd/")
    for f in files:
        if top(f) == "python_client" and f.endswith((".py", ".toml", ".cfg")):
            with open(os.path.join(root, f), encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if re.search(r"""["'/]hostd/""", line):
                        errors.append(f"{f}:{n}: refers to a path under hostd/")

    # Rule 3: strongly connected components of the module graph (Tarjan, iterative).
    index, low, on_stack, stack, counter = {}, {}, set(), [], [0]
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == node:
                        break
                if len(scc) > 1:
                    cycles.append(sorted(scc))
    for scc in cycles:
        errors.append("include cycle among " + ", ".join(scc))
    return errors


def self_test():
    cases = {
        "client includes hostd": {"rankclient/a.cc": '#include "hostd/engine.h"\n',
                                  "hostd/engine.h": ""},
        "client links hostd": {"slidedpctl/CMakeLists.txt": "target_link_libraries(x slidedp_hostd_core)\n",
                               "hostd/CMakeLists.txt": "slidedp_library(slidedp_hostd_core SRCS a.cc)\n"},
        "python refers to hostd": {"python_client/slidedp/x.py": 'P = "../hostd/engine.cc"\n'},
        "upward include": {"model/m.cc": '#include "hostd/state.h"\n', "hostd/state.h": ""},
        "same layer": {"hostd/x.cc": '#include "rankclient/rank_client.h"\n',
                       "rankclient/rank_client.h": ""},
        "cycle": {"hostd/a.h": '#include "hostd/b.h"\n', "hostd/b.h": "",
                  "hostd/b.cc": '#include "hostd/a.h"\n'},
    }
    clean = {"hostd/engine.cc": '#include "model/manifest.h"\n#include "hostd/engine.h"\n',
             "hostd/engine.h": '#include "common/x.h"\n', "model/manifest.h": "", "common/x.h": "",
             "hostd/engine_test.cc": '#include "rankclient/rank_client.h"\n',
             "rankclient/rank_client.h": '#include "model/manifest.h"\n'}
    failed = []
    for name, tree in list(cases.items()) + [("clean", clean)]:
        with tempfile.TemporaryDirectory() as d:
            for path, text in tree.items():
                os.makedirs(os.path.dirname(os.path.join(d, path)), exist_ok=True)
                with open(os.path.join(d, path), "w", encoding="utf-8") as fh:
                    fh.write(text)
            errors = check(d)
        if (name == "clean") == bool(errors):
            failed.append(f"{name}: {errors or 'no breach found'}")
    for f in failed:
        print("self-test:", f)
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} layering breach(es); see the rules in {__file__}")
        return 1
    print("layering: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
