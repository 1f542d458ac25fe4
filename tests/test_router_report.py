"""The router report (Utils/router_report.py + its page Utils/router_report.html): token texts travel as escaped JSON
and are set as text, and the page, opened from disk in headless Chromium, draws without a script error, follows
the layer chosen in its address, and shows something on a screenshot. Built from small synthetic router records
(tests/test_infer.py checks the one Infer.py --save_weights writes)."""
import json
import re

import matplotlib.image
import numpy as np
from browser import chromium, needs_browser, page_dom

from Utils import router_report

TYPES = ["Q", "K", "V", "O", "FFN_DOWN", "PADAPTER"]
HOSTILE = ["</script><script>document.title='pwned'</script>", " <img src=x onerror=\"document.title='pwned'\">"]


def records(variant: str, n_layers=3, seed=0):
    """type_weight and token_weight dicts as Infer.py --save_weights writes them: two data sets of three examples,
    prompts holding markup that must stay text, layers whose weights differ (layer k's weights shifted by k)."""
    rng = np.random.default_rng(seed)
    types, tokens_ = [], []
    for dataset in ("AddSub", "AQuA"):
        for i in range(3):
            words = ["<|begin_of_text|>", "Below", " is", *HOSTILE, "\n", "###", " Response", ":", " The", " answer",
                     f" {i}"]
            n = len(words)
            weights = [np.clip(rng.random((n, len(TYPES))) + 0.2 * layer - 0.3, 0, 1).astype(np.float32)
                       for layer in range(n_layers)]
            gammas = [np.full((n, 1), 0.1 + 0.1 * layer, np.float32) + rng.random((n, 1)).astype(np.float32) * 0.05
                      if variant == "sparse" else None for layer in range(n_layers)]
            common = {"dataset": dataset, "index": i, "tokens": words, "token_ids": list(range(n)), "n_prompt": 8,
                      "generation": ""}
            types.append({**common, "weights": weights})
            tokens_.append({**common, "weights": gammas})
    base = {"method": "moa", "variant": variant, "layer_types": [TYPES] * n_layers}
    return {"kind": "type_weight", **base, "examples": types}, {"kind": "token_weight", **base, "examples": tokens_}


def report(path, variant="sparse", predictions=None, **kwargs):
    type_data, token_data = records(variant)
    run = router_report.run_view(type_data, token_data, predictions or {}, label="<i>run</i>", per_dataset=2)
    return router_report.write_report(str(path), router_report.report_data([run], "Router <b>report</b>", **kwargs))


def embedded(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)[1])


def test_token_text_is_escaped_json_and_survives_whole(tmp_path):
    """The prompt's markup cannot end the data's script element (no raw <, > or & in it) and comes back from the
    JSON exactly as the tokenizer gave it; the tables average over every example, the tokens are of two per set."""
    html = open(report(tmp_path / "r.html")).read()
    data_text = re.search(r'id="report-data">(.*?)</script>', html, re.S)[1]
    assert not set("<>&") & set(data_text)
    data = embedded(html)
    run = data["runs"][0]
    assert [(ex["dataset"], ex["index"]) for ex in run["examples"]] == [("AddSub", 0), ("AddSub", 1), ("AQuA", 0),
                                                                        ("AQuA", 1)]
    assert run["examples"][0]["tokens"][3:5] == HOSTILE and data["title"] == "Router <b>report</b>"
    type_data, _ = records("sparse")
    mean = np.mean(np.concatenate([ex["weights"][1] for ex in type_data["examples"]]), 0)
    np.testing.assert_allclose(run["mean"][1], mean, atol=1e-4)
    assert run["active_rule"] == "w > 0" and data["scales"]["mean"][0] == 0 and data["scales"]["active"] == [0, 6]


def token_colours(page: str) -> list:
    return re.findall(r'<span class="(?:prompt|answer)"[^>]*? style="background: (rgb\([^)]*\))', page)


@needs_browser
def test_page_draws_without_errors_and_follows_the_layer_chosen(tmp_path):
    path = report(tmp_path / "r.html", predictions={("AddSub", 0): {"correct": True, "answer": "0", "prediction": "0"},
                                                    ("AQuA", 1): {"correct": False, "answer": "B", "prediction": "A"}})
    marks, colours = {}, {}
    for layer in (0, 2):
        rendered, errors, page = page_dom(path, f"#layer={layer}&by=gamma")
        assert (rendered, errors) == (f"layer {layer} by gamma", "")
        assert "<img" not in page and "pwned" not in re.search(r"<title>(.*?)</title>", page)[1]
        assert page.count('">&lt;/script&gt;&lt;script&gt;') == 4  # the prompt's markup shown as text
        assert "✓ correct" in page and "✗ wrong" in page and "answer B, predicted A" in page
        marks[layer] = re.findall(r'class="selected-layer"[^>]*|<rect[^>]*class="selected-layer"', page)
        colours[layer] = token_colours(page)
    assert len(colours[0]) == len(colours[2]) == 4 * 12  # every token of 4 examples coloured
    assert colours[0] != colours[2] and marks[0] != marks[2]  # Gamma of another layer, its row marked
    rendered, errors, page = page_dom(path, "#layer=1&by=active")
    assert (rendered, errors) == ("layer 1 by active", "") and token_colours(page) != colours[0]


@needs_browser
def test_a_soft_run_and_a_broken_page(tmp_path):
    """Soft MoA has no Gamma: its tokens are coloured by the strongest type. A page whose data is broken and that
    loads an image from the network says both in #errors (what the other tests read is no vacuous empty): the
    script's error, and the load its Content-Security-Policy blocked."""
    rendered, errors, page = page_dom(report(tmp_path / "soft.html", "soft"))
    assert (rendered, errors) == ("layer 0 by top", "") and "Gamma" not in page.split('id="by"')[1].split("</select>")[0]
    assert len(set(token_colours(page))) > 2  # several types win somewhere
    broken = tmp_path / "broken.html"
    broken.write_text(router_report.page({"title": "x", "notes": [], "scales": {}, "type_colours": []}).replace(
        "</body>", '<img src="http://192.0.2.1/x.png"></body>'))
    rendered, errors, _ = page_dom(broken)
    assert rendered is None and errors.startswith("error: Uncaught TypeError")
    assert "error: blocked img-src http://192.0.2.1/x.png" in errors


@needs_browser
def test_screenshot_shows_the_report(tmp_path):
    path = report(tmp_path / "r.html")
    shot = tmp_path / "shot.png"
    result = chromium("--window-size=1200,900", f"--screenshot={shot}", f"file://{path}#layer=1")
    assert shot.is_file(), result.stderr[-2000:]
    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (900, 1200)
    inked = (pixels < 0.9).any(-1).mean()  # text, heatmaps and coloured tokens on a white page
    saturated = (pixels.max(-1) - pixels.min(-1) > 0.3).mean()  # colour, not only black text
    assert 0.05 < inked < 0.8 and saturated > 0.02, (inked, saturated)
