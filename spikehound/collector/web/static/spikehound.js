/* spikehound pages: place the waterfall bars, draw the charts (uPlot, vendored) and the profile's flame graphs.
 *
 * The pages are rendered on the server; this script only positions what is there
 * (bars from data-* attributes: the Content-Security-Policy allows no inline
 * style) and draws the charts of a spike page from its JSON block. Every chart
 * gets the same x range and the same y-axis width, so their time axes line up,
 * and they share one cursor and one zoom (drag to zoom, double-click to reset).
 * Text is never built from data here: labels go in through textContent or uPlot.
 */
"use strict";

(function () {
  var PALETTE = ["#3b6fb6", "#d0771e", "#2a9d8f", "#8e44ad", "#c0392b", "#6c757d", "#b7950b", "#16a085",
                 "#5d6d7e", "#a04000", "#1f618d", "#7d3c98"];
  var NO_POINTS = {show: false};
  var AXIS_SIZE = 72; // px; the same on every chart, so the plots share their left edge

  function placeBars() {
    var rows = document.querySelectorAll(".row[data-l]");
    for (var i = 0; i < rows.length; i++) {
      var row = rows[i];
      row.style.setProperty("--l", row.dataset.l + "%");
      row.style.setProperty("--w", row.dataset.w + "%");
      row.style.setProperty("--d", String(Math.min(+row.dataset.d, 24)));
    }
    var fills = document.querySelectorAll(".fill[data-share]");
    for (var j = 0; j < fills.length; j++) {
      fills[j].style.width = (100 * Math.max(0, Math.min(1, +fills[j].dataset.share))) + "%";
    }
  }

  function openTarget() {
    // A link to a span (#span-..., #s-...) shows it even when the waterfall shows the critical path only.
    var id = decodeURIComponent(location.hash.slice(1));
    var el = id && document.getElementById(id);
    if (!el) return;
    if (el.tagName === "DETAILS") el.open = true;
    for (var d = el.parentElement && el.parentElement.closest("details"); d; d = d.parentElement && d.parentElement.closest("details")) {
      d.open = true; // a span folded into a group: open the group
    }
    var wf = el.closest(".waterfall");
    var box = wf && wf.querySelector(".cp-only input");
    if (box && box.checked && !el.classList.contains("cp") && !(el.querySelector(".cp"))) box.checked = false;
    el.scrollIntoView({block: "center"});
  }

  function bytes(v) {
    var units = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    var i = 0;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
    return (Math.abs(v) >= 10 || v === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  }

  function formatter(unit) {
    if (unit === "%") return function (v) { return v == null ? "–" : v.toFixed(v < 10 && v !== 0 ? 1 : 0) + "%"; };
    if (unit === "ms") return function (v) { return v == null ? "–" : (v >= 100 ? v.toFixed(0) : v.toFixed(1)) + " ms"; };
    if (unit === "B/s" || unit === "By/s") return function (v) { return v == null ? "–" : bytes(v); };
    return function (v) { return v == null ? "–" : (Math.abs(v) >= 100 ? v.toFixed(0) : +v.toPrecision(3)) + (unit ? " " + unit : ""); };
  }

  function timeTicks(u, ticks, axisIdx, space, incr) {
    // 24-hour UTC clock times; seconds only when the ticks are less than a minute apart.
    var format = uPlot.fmtDate(incr < 60 ? "{HH}:{mm}:{ss}" : "{HH}:{mm}");
    return ticks.map(function (t) { return format(uPlot.tzDate(new Date(t * 1e3), "Etc/UTC")); });
  }

  function constant(x, value) {
    var out = new Array(x.length);
    for (var i = 0; i < x.length; i++) out[i] = value;
    return out;
  }

  function shadeWindow(windowRange) {
    // The spike's window, as an element over the plot (a test and a person can both find it).
    return function (u) {
      var el = u.over.querySelector(".spike-window");
      if (!el) {
        el = document.createElement("div");
        el.className = "spike-window";
        el.title = "the spike";
        u.over.appendChild(el);
      }
      var plotWidth = u.bbox.width / uPlot.pxRatio; // not u.over.clientWidth: reading layout mid-draw forces it
      var left = Math.max(u.valToPos(windowRange[0], "x"), 0);
      var right = Math.min(u.valToPos(windowRange[1], "x"), plotWidth);
      el.style.left = left + "px";
      el.style.width = Math.max(right - left, 2) + "px";
      el.hidden = right < 0 || left > plotWidth;
    };
  }

  function buildChart(panel, data, box, width) {
    var fmt = formatter(panel.unit);
    var legend = function (u, v) { return fmt(v); };
    var series = [{label: "time (UTC)"}];
    var values = [panel.x];
    var bands = [];
    if (panel.kind === "latency") {
      var steps = uPlot.paths.stepped({align: 1});
      var styles = {p50: ["#9db8dc", 1.5], p95: ["#3b6fb6", 1.5], p99: ["#d63031", 2.5]};
      if (panel.band) {
        values.push(constant(panel.x, panel.band[1]), constant(panel.x, panel.band[0]));
        series.push({label: "normal p99 high", stroke: "rgba(46,160,67,0.5)", width: 1, value: legend, points: NO_POINTS},
                    {label: "normal p99 low", stroke: "rgba(46,160,67,0.5)", width: 1, value: legend, points: NO_POINTS});
        bands.push({series: [1, 2], fill: "rgba(46,160,67,0.14)"});
      }
      values.push(constant(panel.x, panel.baseline));
      series.push({label: "baseline p99", stroke: "#2e8b57", width: 1.5, dash: [6, 4], value: legend, points: NO_POINTS});
      panel.series.forEach(function (s) {
        var st = styles[s.label] || ["#555", 1];
        values.push(s.values);
        series.push({label: s.label, stroke: st[0], width: st[1], paths: steps, value: legend, spanGaps: false,
                     points: NO_POINTS});
      });
    } else {
      panel.series.forEach(function (s, i) {
        values.push(s.values);
        series.push({label: s.label, stroke: PALETTE[i % PALETTE.length], width: 1.5, value: legend, spanGaps: false});
      });
    }
    var yRange = panel.unit === "%"
      ? function (u, min, max) { return [0, Math.max(100, max || 0)]; }
      : function (u, min, max) { return [0, max > 0 ? max * 1.12 : 1]; };
    var opts = {
      width: width,
      height: panel.kind === "latency" ? 230 : 150,
      tzDate: function (ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); },
      scales: {x: {time: true, auto: false, range: function () { return data.view.slice(); }},
               y: {range: yRange}},
      axes: [{space: 70, values: timeTicks}, {size: AXIS_SIZE, values: function (u, ticks) { return ticks.map(fmt); }}],
      series: series,
      bands: bands,
      legend: {live: true},
      cursor: {sync: {key: "spikehound", setSeries: false}, drag: {x: true, y: false, setScale: false},
               bind: {dblclick: function () { return null; }}},
      hooks: {draw: [shadeWindow(data.window)], setSelect: [zoomFrom]}
    };
    return new uPlot(opts, values, box);
  }

  var charts = [];

  function zoomFrom(u) {
    if (u.select.width < 5) return;
    var min = u.posToVal(u.select.left, "x"), max = u.posToVal(u.select.left + u.select.width, "x");
    u.setSelect({left: 0, top: 0, width: 0, height: 0}, false);
    setView([min, max]);
  }

  function setView(view) {
    var data = window.spikehound.data;
    data.view = view;
    charts.forEach(function (c) { c.setScale("x", {min: view[0], max: view[1]}); });
  }

  function drawCharts() {
    var block = document.getElementById("chart-data");
    if (!block || typeof uPlot === "undefined") return;
    var data = JSON.parse(block.textContent);
    data.view = data.range.slice();
    window.spikehound.data = data;
    // Every width is read before any chart is made: one layout, not one per chart.
    var boxes = data.panels.map(function (panel) {
      return document.querySelector('.chart[data-panel="' + panel.id + '"]');
    });
    var widths = boxes.map(function (box) { return box ? Math.max(box.clientWidth, 200) : 0; });
    data.panels.forEach(function (panel, i) {
      if (!boxes[i]) return;
      var chart = buildChart(panel, data, boxes[i], widths[i]);
      chart.over.addEventListener("dblclick", function () { setView(data.range.slice()); });
      charts.push(chart);
    });
    window.spikehound.charts = charts;
    if (typeof ResizeObserver !== "undefined") {
      var pending = false;
      new ResizeObserver(function () {
        if (pending) return;
        pending = true;
        requestAnimationFrame(function () {
          pending = false;
          charts.forEach(function (c) {
            var w = Math.max(c.root.parentNode.clientWidth, 200);
            if (Math.abs(w - c.width) > 1) c.setSize({width: w, height: c.height});
          });
        });
      }).observe(document.querySelector(".charts") || document.body);
    }
  }

  // --- the differential flame graphs of the profile section -----------------------------------
  var FLAME_ROW = 18; // px per stack level
  var FLAME_MIN_WIDTH = 0.0005; // of the spike's samples: narrower boxes are not drawn (they would not show)

  function flameColour(growth, hasBaseline) {
    // Red when the frame's share of the samples grew, blue when it shrank; a 20-point change is full colour.
    if (!hasBaseline) return "hsl(35, 70%, 72%)";
    var strength = Math.min(1, Math.abs(growth) / 0.2);
    var lightness = 92 - 40 * strength;
    return growth >= 0 ? "hsl(4, 75%, " + lightness + "%)" : "hsl(215, 65%, " + lightness + "%)";
  }

  function percentText(share) {
    return share > 0 && share < 0.005 ? "<1%" : (100 * share).toFixed(0) + "%";
  }

  function drawFlame(box, root) {
    var spikeAll = root.spike, baseAll = root.baseline;
    if (!spikeAll) return;
    var depth = 0;
    var fragment = document.createDocumentFragment();
    var stack = [{node: root, left: 0, level: 0}];
    while (stack.length) {
      var item = stack.pop();
      var node = item.node, width = node.spike / spikeAll;
      if (width < FLAME_MIN_WIDTH) continue;
      var spikeShare = width, baseShare = baseAll ? node.baseline / baseAll : 0;
      var el = document.createElement("div");
      el.className = "fbox";
      el.dataset.function = node.function;
      el.style.left = (100 * item.left) + "%";
      el.style.width = (100 * width) + "%";
      el.style.top = (item.level * FLAME_ROW) + "px";
      el.style.background = flameColour(spikeShare - baseShare, baseAll > 0);
      el.textContent = node.function;
      el.title = node.function + (node.file ? " (" + node.file + ")" : "") + ": " + percentText(spikeShare) +
        " of samples during the spike (" + node.spike + ")" +
        (baseAll ? ", " + percentText(baseShare) + " before (" + node.baseline + ")" : ", no samples before");
      fragment.appendChild(el);
      depth = Math.max(depth, item.level + 1);
      var offset = item.left;
      for (var i = 0; i < node.children.length; i++) {
        stack.push({node: node.children[i], left: offset, level: item.level + 1});
        offset += node.children[i].spike / spikeAll;
      }
    }
    box.style.height = (depth * FLAME_ROW) + "px";
    box.appendChild(fragment);
  }

  function drawFlames() {
    var block = document.getElementById("chart-data");
    if (!block) return;
    var flames = JSON.parse(block.textContent).flames || [];
    var boxes = document.querySelectorAll(".flame[data-flame]");
    for (var i = 0; i < boxes.length; i++) {
      var tree = flames[+boxes[i].dataset.flame];
      if (tree) drawFlame(boxes[i], tree);
    }
  }

  window.spikehound = {charts: charts, data: null};
  document.addEventListener("DOMContentLoaded", function () {
    if (window.performance && performance.mark) performance.mark("spikehound-start");
    placeBars();
    drawCharts();
    drawFlames();
    openTarget();
    window.addEventListener("hashchange", openTarget);
    document.documentElement.dataset.ready = "1"; // everything placed and drawn (tests and the benchmark wait for it)
    if (window.performance && performance.mark) performance.mark("spikehound-ready");
  });
})();
