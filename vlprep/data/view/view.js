(function () {
  "use strict";
  // Every text of the data reaches the page through textContent or setAttribute, never as HTML.
  var data = JSON.parse(document.getElementById("vlprep-data").textContent);
  var info = data.info;
  var samples = data.samples;
  var PER_PAGE = 48;
  var SVG = "http://www.w3.org/2000/svg";
  var state = { shown: samples, page: 0 };

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }

  function svgEl(tag, attrs) {
    var e = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, String(attrs[k])); });
    return e;
  }

  function score(x) {
    return typeof x === "number" ? x.toFixed(2) : "";
  }

  function figure(s, big) {
    var fig = el("div", big ? "fig big" : "fig");
    if (!s.thumb) {
      fig.appendChild(el("span", "none", "no image"));
      return fig;
    }
    var img = el("img");
    img.src = s.thumb.src;
    img.alt = s.key;
    img.width = s.thumb.w;
    img.height = s.thumb.h;
    fig.appendChild(img);
    if (Array.isArray(s.objects) && s.objects.length) {
      var w = s.thumb.w;
      var h = s.thumb.h;
      var svg = svgEl("svg", { viewBox: "0 0 " + w + " " + h, preserveAspectRatio: "none" });
      var labels = [];
      s.objects.forEach(function (o) {
        if (!o || !Array.isArray(o.box) || o.box.length !== 4) { return; }
        var b = o.box;
        var rect = svgEl("rect", { x: b[0] * w, y: b[1] * h, width: (b[2] - b[0]) * w, height: (b[3] - b[1]) * h });
        rect.setAttribute("data-label", String(o.label));
        svg.appendChild(rect);
        // the label is HTML placed in percent of the image: in the SVG it would scale with the thumbnail
        var t = el("span", "box-label", String(o.label) + " " + score(o.score));
        t.style.left = (100 * b[0]) + "%";
        t.style.top = (100 * b[1]) + "%";
        labels.push(t);
      });
      fig.appendChild(svg);
      labels.forEach(function (t) { fig.appendChild(t); });
    }
    return fig;
  }

  function bowBlock(s) {
    var box = el("div", "bow");
    box.appendChild(el("div", "label", "bow caption"));
    box.appendChild(el("div", "caption deformed", s.captions[0]));
    box.appendChild(el("div", "label", "caption_raw"));
    var raw = el("div", "caption raw");
    s.bow_words.forEach(function (pair, i) {
      if (i) { raw.appendChild(document.createTextNode(" ")); }
      raw.appendChild(el(pair[1] ? "mark" : "del", "", pair[0]));
    });
    box.appendChild(raw);
    return box;
  }

  function list(cls, items) {
    var ul = el("ul", cls);
    items.forEach(function (t) { ul.appendChild(el("li", "", t)); });
    return ul;
  }

  function fields(s, box, all) {
    if (s.bow_words) {
      box.appendChild(bowBlock(s));
    }
    var captions = s.bow_words ? s.captions.slice(1) : s.captions;
    if (!all && !s.bow_words) { captions = captions.slice(0, 1); }
    captions.forEach(function (c) { box.appendChild(el("div", "caption", c)); });
    if (!all && !s.bow_words && s.captions.length > 1) {
      box.appendChild(el("div", "label", "+" + (s.captions.length - 1) + " more captions"));
    }
    if (Array.isArray(s.objects) && s.objects.length) {
      box.appendChild(el("div", "label", "objects"));
      box.appendChild(list("objects", s.objects.map(function (o) { return o.label + " " + score(o.score); })));
    }
    if (Array.isArray(s.nouns) && s.nouns.length) {
      box.appendChild(el("div", "label", "nouns"));
      var classes = s.noun_classes || {};
      var pmi = s.noun_pmi || {};
      box.appendChild(list("nouns", s.nouns.map(function (n) {
        var noun = Array.isArray(n) ? n[0] : n;
        if (!classes[noun]) return String(noun);
        var shown = noun + " \u2192 " + classes[noun];
        return typeof pmi[noun] === "number" ? shown + " (PMI " + pmi[noun].toFixed(2) + ")" : shown;
      })));
    }
    if (Array.isArray(s.nodes) && s.nodes.length) {
      box.appendChild(el("div", "label", "nodes"));
      box.appendChild(el("div", "caption", s.nodes.join(", ")));
    }
    if (s.pseudo) {
      box.appendChild(el("div", "label", "pseudo-caption (" + (s.strategy || "") + ")"));
      if (Array.isArray(s.neighbours)) {
        var caps = s.neighbour_captions || [];
        var items = s.neighbours.map(function (k, i) {
          return typeof caps[i] === "string" ? k + ": " + caps[i] : String(k);
        });
        box.appendChild(el("div", "label", "neighbours (" + items.length + ")"));
        box.appendChild(list("neighbours", all ? items : items.slice(0, 3)));
      }
    }
    if (typeof s.clip_score === "number") {
      box.appendChild(el("div", "label", "clip score " + s.clip_score.toFixed(4)));
    }
  }

  function droppedLine(s) {
    return el("div", "dropped-why", "dropped by " + s.dropped.rule + (s.dropped.detail ? ": " + s.dropped.detail : ""));
  }

  function card(s) {
    var c = el("article", s.dropped ? "card dropped" : "card");
    c.setAttribute("data-key", s.key);
    c.appendChild(figure(s, false));
    c.appendChild(el("div", "key", s.key));
    if (s.dropped) { c.appendChild(droppedLine(s)); }
    fields(s, c, false);
    c.addEventListener("click", function () { openDetail(s); });
    return c;
  }

  function openDetail(s) {
    var body = document.getElementById("detail-body");
    body.textContent = "";
    body.appendChild(el("h2", "key", s.key));
    body.appendChild(el("div", "where", s.shard + ", sample " + s.index));
    body.appendChild(figure(s, true));
    if (s.dropped) { body.appendChild(droppedLine(s)); }
    fields(s, body, true);
    body.appendChild(el("div", "label", "json"));
    body.appendChild(el("pre", "", JSON.stringify(s.json, null, 2)));
    document.getElementById("detail").hidden = false;
  }

  function closeDetail() {
    document.getElementById("detail").hidden = true;
  }

  function matches(s, q) {
    if (s.key.toLowerCase().indexOf(q) >= 0) { return true; }
    if (s.dropped && String(s.dropped.rule).toLowerCase() === q) { return true; }
    return s.captions.concat(s.caption_raw ? [s.caption_raw] : []).some(function (c) {
      return c.toLowerCase().split(/[^\p{L}\p{N}]+/u).indexOf(q) >= 0;
    });
  }

  function render() {
    var pages = Math.max(1, Math.ceil(state.shown.length / PER_PAGE));
    state.page = Math.min(state.page, pages - 1);
    var main = document.getElementById("cards");
    main.textContent = "";
    state.shown.slice(state.page * PER_PAGE, (state.page + 1) * PER_PAGE).forEach(function (s) {
      main.appendChild(card(s));
    });
    document.getElementById("page").textContent = "page " + (state.page + 1) + " of " + pages + " (" +
      state.shown.length + " samples)";
    document.getElementById("prev").disabled = state.page === 0;
    document.getElementById("next").disabled = state.page >= pages - 1;
  }

  function search() {
    var q = document.getElementById("search").value.trim().toLowerCase();
    state.shown = q ? samples.filter(function (s) { return matches(s, q); }) : samples;
    state.page = 0;
    render();
  }

  function header() {
    document.getElementById("title").textContent = "vlprep view: " + info.dataset;
    document.getElementById("summary").textContent = (info.stage ? "stage " + info.stage + ", " : "") +
      info.shown + " of " + info.total + " samples from " + info.shards + " shards (seed " + info.seed + ")" +
      (info.dropped_shown ? ", then " + info.dropped_shown + " of the samples the filter dropped" : "");
    var notes = document.getElementById("notes");
    (info.notes || []).forEach(function (note) { notes.appendChild(el("li", "", note)); });
    notes.hidden = !(info.notes || []).length;
    var ol = document.getElementById("lineage");
    info.lineage.forEach(function (step) {
      var text = (step.stage ? step.stage + ": " : "source: ") + step.location;
      var li = el("li", "", text);
      if (step.options && Object.keys(step.options).length) {
        li.appendChild(el("pre", "", JSON.stringify(step.options)));
      }
      ol.appendChild(li);
    });
    var figures = document.getElementById("figures");
    (info.figures || []).forEach(function (f) {
      var fig = el("figure", "figure");
      var img = el("img");
      img.src = f.src;
      img.alt = f.name;
      fig.appendChild(img);
      fig.appendChild(el("figcaption", "", f.name));
      figures.appendChild(fig);
    });
    document.getElementById("figures-box").hidden = !(info.figures || []).length;
    var report = document.getElementById("report");
    if (info.report && Object.keys(info.report).length) {
      report.textContent = JSON.stringify(info.report, null, 2);
    } else {
      document.getElementById("report-box").hidden = true;
    }
  }

  document.getElementById("search").addEventListener("input", search);
  document.getElementById("prev").addEventListener("click", function () { state.page -= 1; render(); });
  document.getElementById("next").addEventListener("click", function () { state.page += 1; render(); });
  document.getElementById("detail-close").addEventListener("click", closeDetail);
  document.getElementById("detail").addEventListener("click", function (e) {
    if (e.target.id === "detail") { closeDetail(); }
  });
  document.addEventListener("keydown", function (e) {
    if (e.key === "Escape") { closeDetail(); }
  });
  header();
  render();
}());
