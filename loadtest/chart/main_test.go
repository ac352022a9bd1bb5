package main

import (
	"encoding/xml"
	"io"
	"strings"
	"testing"
)

const sampleTSV = "row\tmodule\tcpu_x\tcpu_min\tcpu_max\trps_x\trps_min\trps_max\tbar\n" +
	"allow\tours\t1.01\t0.9\t1.2\t0.99\t0.8\t1.1\t1.04\n" +
	"allow\tpeer\t1.05\t0.9\t1.9\t0.98\t0.5\t1.1\t-\n" +
	"redis_keys100k\tours\t3.2\t1.1\t4.0\t0.5\t0.2\t0.9\t1.10\n"

// TestChart_DrawsOneBarPerValue: the SVG is well-formed XML with a bar
// (rect with a title) per module and metric present, the scenarios in
// order, and a ratio above the axis clipped at its top but labelled.
func TestChart_DrawsOneBarPerValue(t *testing.T) {
	rows, err := parse(strings.NewReader(sampleTSV))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := draw(&b, rows, "t <&> t"); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	dec := xml.NewDecoder(strings.NewReader(svg))
	bars, texts := 0, []string{}
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v\n%s", err, svg)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "title" {
			bars++
		}
		if cd, ok := tok.(xml.CharData); ok {
			texts = append(texts, string(cd))
		}
	}
	// allow: ours cpu+rps, peer cpu+rps; redis_keys100k: ours cpu+rps.
	if bars != 6 {
		t.Fatalf("%d bars, want 6", bars)
	}
	all := strings.Join(texts, "|")
	if i, j := strings.Index(all, "allow"), strings.Index(all, "redis_keys100k"); i < 0 || j < 0 || i > j {
		t.Fatalf("scenario labels missing or out of order: %s", all)
	}
	if !strings.Contains(all, "3.20") {
		t.Fatalf("the clipped ratio 3.2 is not labelled: %s", all)
	}
	if y(3.2) != y(maxRatio) {
		t.Fatalf("a ratio above the axis is not clipped: y(3.2)=%v, top %v", y(3.2), y(maxRatio))
	}
}

func TestChart_ParseRejectsBadInput(t *testing.T) {
	for _, in := range []string{
		"header\n",                              // no data rows
		"h\nallow\tours\t1\t1\t1\t1\t1\t1\n",    // 8 fields
		"h\nallow\tours\tx\t1\t1\t1\t1\t1\t-\n", // not a number
		"h\nallow\tmine\t1\t1\t1\t1\t1\t1\t-\n", // unknown module
	} {
		if _, err := parse(strings.NewReader(in)); err == nil {
			t.Errorf("no error for %q", in)
		}
	}
}
