// Command chart draws the load harness's ratios (scripts/loadtest.sh writes
// them to compare.tsv) as an SVG bar chart: per scenario, Caddy's CPU time
// per request and its throughput relative to the baseline, for this module
// and the peer, with the min–max over rounds as a whisker and each bar's
// target as a tick. It uses the standard library only, so the harness needs
// nothing but Go to draw it.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"html"
	"io"
	"os"
	"strconv"
	"strings"
)

// Layout of the chart, in SVG user units (pixels).
const (
	// groupWidth holds one scenario: up to four bars side by side.
	groupWidth = 132
	barWidth   = 26
	plotHeight = 300
	marginLeft = 56
	marginTop  = 56
	// marginBottom leaves room for the scenario names, turned 30 degrees.
	marginBottom = 110
	legendHeight = 24
	// legendStep is the width of one legend entry.
	legendStep = 170
	// maxRatio is the top of the y axis: ratios above it are clipped and
	// labelled with their value, so one outlier does not flatten the rest.
	maxRatio = 2.5
)

// series are the bars of a group, in order: what column of the TSV they
// read and how they look.
var series = []struct {
	module, metric, label, color string
}{
	{"ours", "cpu", "this module: CPU/request", "#1f77b4"},
	{"ours", "rps", "this module: req/s", "#9ecae1"},
	{"peer", "cpu", "peer: CPU/request", "#d62728"},
	{"peer", "rps", "peer: req/s", "#f4a6a6"},
}

// row is one line of compare.tsv.
type row struct {
	scenario, module    string
	cpu, cpuMin, cpuMax float64
	rps, rpsMin, rpsMax float64
	bar                 float64 // 0: no bar
}

func main() {
	in := flag.String("in", "", "compare.tsv written by scripts/loadtest.sh")
	out := flag.String("out", "", "SVG file to write")
	title := flag.String("title", "Ratios to plain Caddy", "chart title")
	flag.Parse()
	if *in == "" || *out == "" {
		fmt.Fprintln(os.Stderr, "usage: chart -in compare.tsv -out compare.svg [-title T]")
		os.Exit(2)
	}
	if err := run(*in, *out, *title); err != nil {
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
}

func run(in, out, title string) error {
	f, err := os.Open(in)
	if err != nil {
		return fmt.Errorf("open the data: %w", err)
	}
	defer f.Close()
	rows, err := parse(f)
	if err != nil {
		return fmt.Errorf("read %s: %w", in, err)
	}
	var b strings.Builder
	if err := draw(&b, rows, title); err != nil {
		return err
	}
	if err := os.WriteFile(out, []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("write the chart: %w", err)
	}
	return nil
}

// parse reads the TSV: a header line, then row, module, cpu_x, cpu_min,
// cpu_max, rps_x, rps_min, rps_max, bar ("-" for none).
func parse(r io.Reader) ([]row, error) {
	sc := bufio.NewScanner(r)
	var rows []row
	for n := 1; sc.Scan(); n++ {
		if n == 1 {
			continue
		}
		f := strings.Split(sc.Text(), "\t")
		if len(f) != 9 {
			return nil, fmt.Errorf("line %d: %d fields, want 9", n, len(f))
		}
		v := make([]float64, 7)
		for i := range v {
			if f[2+i] == "-" {
				continue
			}
			x, err := strconv.ParseFloat(f[2+i], 64)
			if err != nil {
				return nil, fmt.Errorf("line %d, field %d: %w", n, 3+i, err)
			}
			v[i] = x
		}
		if f[1] != "ours" && f[1] != "peer" {
			return nil, fmt.Errorf("line %d: module %q, want ours or peer", n, f[1])
		}
		rows = append(rows, row{f[0], f[1], v[0], v[1], v[2], v[3], v[4], v[5], v[6]})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, errors.New("no data rows")
	}
	return rows, nil
}

func y(ratio float64) float64 {
	if ratio > maxRatio {
		ratio = maxRatio
	}
	if ratio < 0 {
		ratio = 0
	}
	return marginTop + plotHeight*(1-ratio/maxRatio)
}

// draw writes the SVG: groups in the order the scenarios first appear.
func draw(w io.Writer, rows []row, title string) error {
	var scenarios []string
	byKey := map[string]row{}
	for _, r := range rows {
		if _, seen := byKey[r.scenario+"/ours"]; !seen {
			if _, seenPeer := byKey[r.scenario+"/peer"]; !seenPeer {
				scenarios = append(scenarios, r.scenario)
			}
		}
		byKey[r.scenario+"/"+r.module] = r
	}
	width := max(marginLeft+groupWidth*len(scenarios)+20, marginLeft+legendStep*len(series))
	height := marginTop + plotHeight + marginBottom + legendHeight
	p := func(format string, a ...any) { fmt.Fprintf(w, format+"\n", a...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`, width, height, width, height)
	p(`<rect width="100%%" height="100%%" fill="white"/>`)
	p(`<text x="%d" y="22" font-size="15" font-weight="bold">%s</text>`, marginLeft, html.EscapeString(title))
	p(`<text x="%d" y="40" fill="#555">ratio to the baseline (plain Caddy); CPU/request: lower is better, req/s: higher is better; whiskers: min–max over rounds; black ticks: the bar</text>`, marginLeft)
	for t := 0.0; t <= maxRatio+1e-9; t += 0.5 {
		p(`<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="%s"/>`, marginLeft, width-20, y(t), y(t), map[bool]string{true: "#333", false: "#ddd"}[t == 1])
		p(`<text x="%d" y="%.1f" text-anchor="end">%.1f×</text>`, marginLeft-6, y(t)+4, t)
	}
	for g, sc := range scenarios {
		x0 := marginLeft + g*groupWidth + (groupWidth-len(series)*barWidth)/2
		for i, s := range series {
			r, ok := byKey[sc+"/"+s.module]
			if !ok {
				continue
			}
			v, lo, hi := r.cpu, r.cpuMin, r.cpuMax
			if s.metric == "rps" {
				v, lo, hi = r.rps, r.rpsMin, r.rpsMax
			}
			x := float64(x0 + i*barWidth)
			p(`<rect x="%.1f" y="%.1f" width="%d" height="%.1f" fill="%s"><title>%s %s: %.3f× (%.2f–%.2f)</title></rect>`,
				x, y(v), barWidth-3, y(0)-y(v), s.color, html.EscapeString(sc), s.label, v, lo, hi)
			cx := x + float64(barWidth-3)/2
			p(`<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#222"/>`, cx, cx, y(lo), y(hi))
			p(`<text x="%.1f" y="%.1f" text-anchor="middle" font-size="9">%.2f</text>`, cx, y(hi)-3, v)
			if s.metric == "cpu" && r.bar > 0 {
				p(`<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="black" stroke-width="3"/>`, x-2, x+barWidth-1, y(r.bar), y(r.bar))
			}
		}
		lx := float64(marginLeft + g*groupWidth + groupWidth/2)
		p(`<text x="%.1f" y="%d" text-anchor="end" transform="rotate(-30 %.1f %d)">%s</text>`, lx+20, marginTop+plotHeight+18, lx+20, marginTop+plotHeight+18, html.EscapeString(sc))
	}
	ly := marginTop + plotHeight + marginBottom
	for i, s := range series {
		x := marginLeft + i*legendStep
		p(`<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`, x, ly, s.color, x+16, ly+10, s.label)
	}
	p(`</svg>`)
	return nil
}
