"""The command line on a tiny random-weight model (`--model PATH`): JSON shapes, errors, list and delete."""

from __future__ import annotations

import json

import pytest

from app.cli import main, terminal_text
from tests.support.tiny_models import make_tiny_model

DOC = "The harbour wall was rebuilt after the storm. " * 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "doc.txt").write_text(DOC)
    return make_tiny_model(root, "llama_gqa"), root


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_ingested_pdf_keeps_its_file(tiny, tmp_path, capsys):
    """`squeeze ingest` of a PDF keeps its original file (checked against the document's sha256), as an upload
    through the app does: the app's page links can open it; a text file keeps none."""
    from storage import Store
    from tests.support.pdfs import make_text_pdf

    model, root = tiny
    pdf = tmp_path / "wall.pdf"
    pdf.write_bytes(make_text_pdf([DOC[:400], DOC[400:800]]))
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), "--quiet", "--json"]
    code, out, _ = run(capsys, "ingest", str(pdf), *common)
    assert code == 0
    doc_id = json.loads(out)["doc_id"]
    code, out, _ = run(capsys, "ingest", str(root / "doc.txt"), *common)
    text_id = json.loads(out)["doc_id"]
    with Store(tmp_path / "cache") as store:
        assert store.documents.source(doc_id) == pdf.read_bytes()
        assert store.documents.source_file(doc_id) is not None
        assert store.documents.source(text_id) is None


def test_ingest_ask_list_delete(tiny, capsys):
    model, root = tiny
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(root / "cache"), "--quiet"]
    code, out, _ = run(capsys, "ingest", str(root / "doc.txt"), "--json", *common)
    assert code == 0
    ingest = json.loads(out)
    assert set(ingest) >= {"doc_id", "context_id", "tokens", "pages", "seconds"}
    assert ingest["tokens"] == len(DOC.strip()) + 1 and ingest["pages"] == 1  # byte tokenizer + BOS; text stripped
    code, out, _ = run(capsys, "ingest", str(root / "doc.txt"), "--json", *common)
    assert json.loads(out)["cached"] is True and json.loads(out)["context_id"] == ingest["context_id"]
    code, out, _ = run(capsys, "ask", ingest["doc_id"], "What was rebuilt?", "--method", "hsqueeze",
                       "--sparsity", "0.8", "--max-new-tokens", "4", "--json", *common)
    assert code == 0
    answer = json.loads(out)
    assert set(answer) >= {"answer", "method", "sparsity", "kv_budget", "kept_fraction", "clusters", "timings"}
    assert answer["method"] == "hsqueeze" and answer["sparsity"] == 0.8
    assert len(answer["kept_fraction"]) == 2 and all(len(row) == 4 for row in answer["kept_fraction"])
    assert 0 < answer["kv_budget"] < 1
    # the document tokens the turn read as follow rows (engine.attention.follow): the byte tokenizer's repeats find some
    assert answer["follow"] and all(0 <= p < ingest["tokens"] for p in answer["follow"])
    sampled = ["ask", ingest["doc_id"], "What was rebuilt?", "--max-new-tokens", "6", "--temperature", "0.9",
               "--top-p", "0.9", "--repetition-penalty", "1.3", "--seed", "3", "--json", *common]
    first, again = (json.loads(run(capsys, *sampled)[1]) for _ in range(2))
    assert first["answer"] == again["answer"] and first["extra"]["generation"]["seed"] == 3  # seeded: reproducible
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, before the model loads
        run(capsys, *sampled[:-len(common) - 1], "--temperature", "-2", *common)
    assert refused.value.code == 2 and "temperature must be in [0, 10]" in capsys.readouterr().err
    code, out, _ = run(capsys, "list", "--json", *common)
    assert [d["id"] for d in json.loads(out)] == [ingest["doc_id"]]
    code, out, _ = run(capsys, "delete", ingest["doc_id"], *common)
    assert code == 0
    code, out, _ = run(capsys, "list", "--json", *common)
    assert json.loads(out) == []


def test_progress_tells_the_model_load_then_the_ingest(tiny, capsys, tmp_path):
    model, root = tiny
    code, _, err = run(capsys, "ingest", str(root / "doc.txt"), "--model", str(model), "--device", "cpu",
                       "--cache-dir", str(tmp_path / "cache"))
    lines = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("[")]
    loading = [line for line in lines if line.startswith("loading model")]
    assert code == 0 and loading == ["loading model: loading the tokenizer 0/2",
                                     "loading model: loading the weights 1/2", "loading model: loaded 2/2"]
    assert lines.index(loading[-1]) < lines.index(f"prefill 0/{len(DOC.strip()) + 1}")


def test_errors_are_one_line(tiny, capsys, tmp_path):
    model, root = tiny
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(tmp_path), "--quiet"]
    bad = tmp_path / "image.png"
    bad.write_bytes(b"\x89PNG")
    for argv in (["ingest", str(bad), *common], ["ask", "nosuchdoc", "q?", *common],
                 ["ingest", str(tmp_path / "missing.txt"), *common]):
        code, out, err = run(capsys, *argv)
        assert code == 1 and out == ""
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_an_answer_longer_than_the_context_is_refused_in_words(tiny, capsys, tmp_path):
    """An answer length the model's context cannot hold names the most it can; one under 1 is refused by the option
    parser, before anything loads."""
    model, root = tiny
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(tmp_path), "--quiet"]
    code, out, err = run(capsys, "ask", str(root / "doc.txt"), "Why?", "--max-new-tokens", "1000000000", *common)
    assert code == 1 and out == ""
    assert "an answer of 1000000000 tokens does not fit" in err and "ask for at most" in err and "-" not in err.split(
        "at most")[1].split()[0]
    with pytest.raises(SystemExit) as refused:
        main(["ask", str(root / "doc.txt"), "Why?", "--max-new-tokens", "0", *common])
    assert refused.value.code == 2 and "at least 1" in capsys.readouterr().err


def test_a_document_too_long_for_the_model_is_refused_and_not_kept(tiny, capsys, tmp_path):
    """Without --truncate, a document over the model's context is refused in words and leaves nothing in the
    library; with it, its start is kept."""
    model, _ = tiny
    from engine.model.load import load_model  # noqa: PLC0415

    long = tmp_path / "long.txt"
    long.write_text("The harbour wall was rebuilt. " * (load_model(str(model), "cpu").max_context // 10))
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    code, out, err = run(capsys, "ingest", str(long), *common)
    assert code == 1 and "pass --truncate" in err
    assert json.loads(run(capsys, "list", "--json", *common)[1]) == []
    code, out, _ = run(capsys, "ingest", str(long), "--truncate", "--json", *common)
    assert code == 0 and json.loads(out)["tokens"] > 0
    assert len(json.loads(run(capsys, "list", "--json", *common)[1])) == 1


def test_a_50_mb_one_line_text_is_refused_in_seconds(tiny, capsys, tmp_path):
    """A 50 MB text of one line, far over the model's context: refused in words within seconds (the tokenizer reads
    only its start), nothing kept in the library."""
    import time  # noqa: PLC0415

    model, _ = tiny
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"word " * (10 * 2**20))
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    started = time.perf_counter()
    code, out, err = run(capsys, "ingest", str(huge), *common)
    assert code == 1 and "pass --truncate" in err
    assert time.perf_counter() - started < 60  # (81-223 s when the whole text was tokenized)
    assert json.loads(run(capsys, "list", "--json", *common)[1]) == []


def test_list_tells_an_ingest_whose_process_died_as_failed(tmp_path, capsys):
    """A context left "running" by a killed ingest is listed as failed (interrupted) by `squeeze list` itself."""
    from storage import Store, load_document_bytes  # noqa: PLC0415

    with Store(tmp_path) as store:
        doc_id, _ = store.documents.add(load_document_bytes(DOC.encode(), "doc.txt"))
        ctx = store.contexts.context_for(doc_id, "some-model", {})
        job = store.jobs.create(doc_id, "doc.txt", "some-model", {}, context_id=ctx["id"])
        store.jobs.start(job)
        store.contexts.set_status(ctx["id"], "running")
        with store.transaction() as db:  # killed
            db.execute("UPDATE jobs SET pid = ? WHERE id = ?", [2**22 + 12345, job])
    code, out, _ = run(capsys, "list", "--json", "--cache-dir", str(tmp_path))
    assert code == 0 and [d["status"] for d in json.loads(out)] == ["failed"]


def test_control_characters_never_reach_the_terminal(tiny, capsys, tmp_path):
    """An escape sequence in a path (or a question, an answer) is printed as \\xNN, not sent to the terminal."""
    model, _ = tiny
    code, out, err = run(capsys, "ingest", str(tmp_path / "red\x1b[31m.txt"), "--model", str(model), "--device",
                         "cpu", "--cache-dir", str(tmp_path / "cache"), "--quiet")
    assert code == 1 and "\x1b" not in err and "\\x1b[31m" in err
    # what an answer's streamed text and an error go through: every control character but tab and newline escaped
    assert terminal_text("ok\x1b]0;owned\x07 \x9b2J\tkept\nkept") == "ok\\x1b]0;owned\\x07 \\x9b2J\tkept\nkept"


def test_a_named_pipe_is_refused_without_reading_it(tiny, capsys, tmp_path):
    """`squeeze ingest` of a named pipe is refused in one line at once (a read would block until a writer came)."""
    import os  # noqa: PLC0415

    model, _ = tiny
    pipe = tmp_path / "notes.txt"
    os.mkfifo(pipe)
    code, out, err = run(capsys, "ingest", str(pipe), "--model", str(model), "--device", "cpu", "--cache-dir",
                         str(tmp_path / "cache"), "--quiet")
    assert code == 1 and "notes.txt: not a regular file" in err and len(err.strip().splitlines()) == 1


def test_method_options_build_that_index_once(tiny, capsys, tmp_path):
    """`--{method}-{setting}` options (from the registry): the context is the same; the method's index is rebuilt
    with the settings when they differ from the ones it was built with, and reused when they do not. A method not
    built at ingest (`--methods`) is built at its first question."""
    from storage import Store  # noqa: PLC0415

    model, root = tiny
    cache = tmp_path / "cache"
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(cache), "--quiet", "--json"]
    ask = ["What was rebuilt?", "--max-new-tokens", "2", *common]
    code, out, _ = run(capsys, "ingest", str(root / "doc.txt"), *common)
    default = json.loads(out)
    context = default["context_id"]

    def built() -> dict:
        with Store(cache) as store:
            return {b["method"]: b["settings"][b["method"]] for b in store.methods.list(context)}

    assert set(built()) == {"squeeze"} and built()["squeeze"]["centroid_ratio"] == 0.05
    code, out, _ = run(capsys, "ask", default["doc_id"], *ask, "--centroid-ratio", "0.1",
                       "--squeeze-prefill-threshold", "calibrated")
    assert code == 0 and json.loads(out)["context_id"] == context
    assert built()["squeeze"] == {**built()["squeeze"], "centroid_ratio": 0.1, "prefill_threshold": "calibrated"}
    first = Store(cache)
    stamp = first.methods.get(context, "squeeze")["built_at"]
    first.close()
    code, out, _ = run(capsys, "ask", str(root / "doc.txt"), *ask, "--squeeze-centroid-ratio", "0.1",
                       "--squeeze-prefill-threshold", "calibrated")
    assert code == 0 and json.loads(out)["context_id"] == context
    with Store(cache) as store:
        assert store.methods.get(context, "squeeze")["built_at"] == stamp  # the same settings: reused
    code, out, _ = run(capsys, "ask", default["doc_id"], *ask, "--method", "quest", "--quest-page-size", "8")
    assert code == 0 and json.loads(out)["method"] == "quest"
    assert built()["quest"]["page_size"] == 8
    with pytest.raises(SystemExit) as refused:  # by the parser, before anything loads
        run(capsys, "ask", default["doc_id"], *ask, "--quest-page-size", "6")
    assert refused.value.code == 2 and "must be a power of two, got 6" in capsys.readouterr().err
    code, _, err = run(capsys, "ingest", str(root / "doc.txt"), *common, "--methods", "squeeze,nope")
    assert code == 1 and "unknown method(s) nope" in err


def test_compile_gives_the_same_answer(tiny, capsys, tmp_path):
    """`--compile` (engine.model.compiled): the decoder layers under torch.compile answer as the eager model does."""
    model, root = tiny
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(tmp_path), "--quiet", "--json"]
    ask = ["ask", str(root / "doc.txt"), "What was rebuilt?", "--method", "squeeze", "--sparsity", "0.5",
           "--max-new-tokens", "4"]
    code, eager, _ = run(capsys, *ask, *common)
    assert code == 0
    code, compiled, _ = run(capsys, *ask, *common, "--compile")
    assert code == 0
    assert json.loads(compiled)["answer"] == json.loads(eager)["answer"]


def test_the_catalog_names_the_registered_methods():
    """engine.model.catalog (what the command line knows without torch) agrees with the method registry."""
    from engine.methods import REGISTRY
    from engine.model.catalog import METHODS, SPARSE_METHODS, TRAINED_METHODS

    assert METHODS == tuple(REGISTRY)
    assert SPARSE_METHODS == tuple(n for n, cls in REGISTRY.items() if cls.sparse)
    assert TRAINED_METHODS == tuple(n for n, cls in REGISTRY.items() if cls.learns_per_model())


def test_one_default_turn_everywhere():
    """The command line, the app and the engine start a turn with the same method and sparsity (the catalog's)."""
    import inspect

    from app.cli import build_parser
    from app.config import AppConfig
    from engine.model.catalog import DEFAULT_METHOD, DEFAULT_SPARSITY
    from engine.serve import Engine

    args = build_parser().parse_args(["ask", "doc.txt", "What was rebuilt?"])
    assert (args.method, args.sparsity) == (DEFAULT_METHOD, DEFAULT_SPARSITY)
    assert (AppConfig().method, AppConfig().sparsity) == (DEFAULT_METHOD, DEFAULT_SPARSITY)
    stream = inspect.signature(Engine.stream).parameters
    assert (stream["method"].default, stream["sparsity"].default) == (DEFAULT_METHOD, DEFAULT_SPARSITY)


@pytest.mark.parametrize("argv", [["--help"], ["list"], ["list", "--json"], ["delete", "nosuchdoc"]])
def test_quick_commands_load_neither_torch_nor_transformers(argv, tmp_path):
    """`squeeze --help`, `list` and `delete` answer without importing the model stack (seconds on these machines:
    they take a fraction of one). In a fresh interpreter, as a user's shell runs them."""
    import subprocess
    import sys

    code = ("import sys\nfrom app.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', sorted(m for m in ('torch', 'transformers', 'gradio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *argv, *([] if argv == ["--help"] else
                                                              ["--cache-dir", str(tmp_path)])],
                         capture_output=True, text=True, timeout=60)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr
    if argv[0] == "delete":
        assert "error: " in out.stderr and "nosuchdoc" in out.stderr  # a plain one-line refusal


def test_serving_beyond_this_machine_needs_a_login(tmp_path, capsys, monkeypatch):
    """`--host` other than localhost without a login is refused at once (before torch or gradio load); with
    --auth-file (or --auth) the app is served with those logins; malformed logins are refused. (`--batch` reaches
    the engine, and the app hands it at least that many questions at once.)"""

    import app.serve

    served = []
    monkeypatch.setattr(app.serve, "serve", lambda *args, **kwargs: served.append((args, kwargs)))
    code, _, err = run(capsys, "serve", "--host", "0.0.0.0")
    assert code == 1 and "--host 0.0.0.0 lets anyone who can reach this machine read every document" in err
    assert not served
    logins = tmp_path / "logins"
    logins.write_text("ana:s3cret\n\nbo:pa:ss\n")
    assert run(capsys, "serve", "--host", "0.0.0.0", "--auth-file", str(logins))[0] == 0
    assert served[-1][1]["auth"] == [("ana", "s3cret"), ("bo", "pa:ss")] and served[-1][0][0] == "0.0.0.0"
    assert run(capsys, "serve", "--auth", "me:pw")[0] == 0 and served[-1][1]["auth"] == [("me", "pw")]
    assert run(capsys, "serve")[0] == 0 and served[-1][1]["auth"] == []  # localhost: no login needed
    assert served[-1][1]["batch"] is None  # the engine's default for the device
    assert run(capsys, "serve", "--batch", "12")[0] == 0 and served[-1][1]["batch"] == 12
    assert served[-1][1]["config"].questions_at_once == 12  # the app hands the engine a batch's worth at least
    code, _, err = run(capsys, "serve", "--host", "0.0.0.0", "--auth", "nopassword")
    assert code == 1 and "USER:PASSWORD" in err and len(served) == 4


def test_the_exposure_check_loads_no_torch():
    """What `squeeze serve` checks first imports neither torch nor gradio (a refusal takes no seconds)."""
    import subprocess
    import sys

    code = ("import sys; from app.serve import check_exposure, parse_auth; check_exposure('127.0.0.1', []); "
            "print('torch' in sys.modules, 'gradio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("argv,message", [
    (["ask", "x.txt", "q", "--method", "bogus"], "invalid choice: 'bogus'"),
    (["ask", "x.txt", "q", "--sparsity", "2"], "sparsity must be between 0 and"),
    (["ask", "x.txt", "q", "--temperature", "-1"], "temperature must be in [0, 10]"),
    (["ask", "--squeeze-kmeans-iters", "3", "x.txt", "q", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["ask", "--centroid-ratio=0.2", "x.txt", "q", "--max-new-tokens", "0"], "at least 1, got 0"),
    (["ingest", "x.txt", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["serve", "--port", "99999"], "a port is a whole number from 0 to 65535"),
    (["serve", "--batch", "0"], "a whole number of 1 or more, got 0"),
    (["train", "--duo-train-steps", "5", "duo", "--sparsity", "3"], "unrecognized arguments: --sparsity 3"),
    (["ask", "x.txt", "q", "--squeeze-centroid-ratio", "abc"], "invalid float value: 'abc'"),
    (["ask", "x.txt", "q", "--quest-page-size", "1.5"], "invalid int value: '1.5'"),
    (["ask", "x.txt", "q", "--squeeze-centroid-ratio", "2"], "--squeeze-centroid-ratio/--centroid-ratio: must be in "
                                                              "(0, 1], got 2"),
    (["ingest", "x.txt", "--quest-page-size", "12"], "must be a power of two, got 12"),
    (["train", "duo", "--duo-train-lr", "0"], "--duo-train-lr: must be above 0, got 0"),
    (["ingest", "x.txt", "--saap-dense-first-layer", "maybe"], "--saap-dense-first-layer"),
    (["ask", "x.txt", "q", "--squeeze-no-such-setting", "1"], "unrecognized arguments: --squeeze-no-such-setting"),
    (["train", "duo", "--duo-train-min-tokens", "5000"], "--duo-train-min-tokens (5000) may not exceed "
                                                          "--duo-train-max-tokens (2048)"),
    (["train", "duo", "--duo-train-max-tokens", "900", "--duo-train-min-tokens", "950"], "may not exceed"),
])
def test_bad_options_are_refused_before_torch_loads(argv, message):
    """A bad option of any command (a method's settings around it or not) is refused by argparse, exit code 2,
    before torch is imported: in a fraction of a second, not after the model loads."""
    import subprocess
    import sys

    code = (f"import sys\nfrom app.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as exc:\n"
            f"    print(exc.code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["2", "False"]
    assert message in done.stderr


def test_the_command_lines_method_settings_are_the_registrys():
    """app/method_flags.py, which types the methods' flags without loading them, holds every registered method's
    settings with their defaults: a setting added, renamed or given another default shows here."""
    import dataclasses

    from app.method_flags import METHOD_SETTINGS
    from engine.serve import REGISTRY

    assert METHOD_SETTINGS == {name: {f.name: getattr(cls.Settings(), f.name) for f in dataclasses.fields(cls.Settings)}
                               for name, cls in REGISTRY.items()}
    assert all(type(v) is type(getattr(REGISTRY[m].Settings(), k)) for m, s in METHOD_SETTINGS.items()
               for k, v in s.items())


def _probes(kind: type, allowed) -> tuple[list, list]:
    """Values of a setting of type `kind` inside `allowed` (its closed bounds, one between, a large one) and just
    outside it (open bounds, one step past closed ones)."""
    step = 1 if kind is int else 1e-3
    inside, outside = [], []
    if allowed.pow2:
        return [1, 2, 1024], [0, 3, 12, -2]
    if allowed.zero:
        inside.append(kind(0))
        outside.append(kind(allowed.low) / 2 if kind is float else -1)
    for bound, is_open, sign in ((allowed.low, allowed.low_open, -1), (allowed.high, allowed.high_open, 1)):
        if bound is None:
            inside.append(kind(10**5 if sign > 0 else -(10**5)))
            continue
        outside.append(kind(bound) if is_open else kind(bound) + sign * step)
        if not is_open:
            inside.append(kind(bound))
    if allowed.low is not None and allowed.high is not None:
        inside.append(kind((allowed.low + allowed.high) / 2) if kind is float else kind(allowed.low + 1))
    elif allowed.low is not None:
        inside.append(kind(allowed.low + 1 + step))
    return inside, outside


def test_the_command_lines_ranges_are_what_the_methods_settings_refuse():
    """Each range app/method_flags.py declares (read without torch) refuses what the method's own settings refuse
    just past its bounds and takes what they take within (a setting bound to another, duo's train_min_tokens <=
    train_max_tokens, within the other's default only); every number setting without a range takes anything."""
    from app.method_flags import METHOD_SETTINGS, ORDERED, RANGES, unordered
    from engine.methods import make_method

    duo = METHOD_SETTINGS["duo"]
    related = {("duo", "train_min_tokens"): lambda v: v <= duo["train_max_tokens"],
               ("duo", "train_max_tokens"): lambda v: v >= duo["train_min_tokens"]}
    for (method, name), allowed in RANGES.items():
        kind = type(METHOD_SETTINGS[method][name])
        inside, outside = _probes(kind, allowed)
        for value in outside:
            assert not allowed.allows(value), (method, name, value)
            with pytest.raises(ValueError):
                make_method(method, {name: value})
        for value in inside:
            assert allowed.allows(value), (method, name, value)
            if (method, name) not in related or related[method, name](value):
                make_method(method, {name: value})
    for method, settings in METHOD_SETTINGS.items():
        for name, default in settings.items():
            if type(default) in (int, float) and (method, name) not in RANGES:
                for value in (-(10**9), 0, 10**9):
                    make_method(method, {name: type(default)(value)})  # declare its range if this refuses it
    for method, low, high in ORDERED:  # each relation the flags check is one the settings hold
        at = METHOD_SETTINGS[method][high]
        assert unordered({method: {low: at + 1}}) and not unordered({method: {low: at}})
        with pytest.raises(ValueError):
            make_method(method, {low: at + 1})
        make_method(method, {low: at})


def test_a_commands_help_lists_the_methods_settings(capsys):
    """`squeeze ask --help` is the whole command's help (the quick check of the options steps aside for it)."""
    from app.cli import main

    with pytest.raises(SystemExit) as done:
        main(["ask", "--help"])
    assert done.value.code == 0 and "--squeeze-centroid-ratio" in capsys.readouterr().out


def test_ask_on_a_read_only_cache_answers_without_writing(tiny, capsys, tmp_path, monkeypatch):
    """A cache this process may not write (os.access says so, as on a read-only mount; root ignores permissions, so
    the test tells it): `squeeze ask` answers from the indexes it holds and writes nothing; a question that needs a
    write (a method whose index is not built) is refused in one plain line."""
    import os  # noqa: PLC0415

    import storage.database  # noqa: PLC0415

    model, root = tiny
    cache = tmp_path / "cache"
    common = ["--model", str(model), "--device", "cpu", "--cache-dir", str(cache), "--quiet", "--json"]
    code, out, _ = run(capsys, "ingest", str(root / "doc.txt"), *common)
    assert code == 0
    doc_id = json.loads(out)["doc_id"]

    def files() -> dict:
        return {p: p.stat().st_mtime_ns for p in cache.rglob("*")}

    before = files()
    monkeypatch.setattr(storage.database.os, "access", lambda path, mode: not mode & os.W_OK)
    for doc in (doc_id, str(root / "doc.txt")):  # by its id, and by its file (the same bytes: a hit)
        code, out, err = run(capsys, "ask", doc, "What was rebuilt?", "--max-new-tokens", "4", *common)
        assert code == 0 and "error" not in err, err
        answer = json.loads(out)
        assert answer["method"] == "squeeze" and isinstance(answer["answer"], str) and 0 < answer["kv_budget"] <= 1
    code, out, err = run(capsys, "ask", doc_id, "What was rebuilt?", "--method", "quest", "--max-new-tokens", "4",
                         *common)
    assert code == 1 and out == ""
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"error: the cache at {cache} is read-only here and has no quest index of this "
                                    "document with these settings (squeeze has one); building it needs write access")
    assert files() == before
