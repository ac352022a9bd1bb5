package origin

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

func TestParseMany_ReadsCellsInOrderAndStopsAtAMalformedReply(t *testing.T) {
	tot := func(v ...int64) engine.Totals { return totalsOf([6]int64(v)) }
	for _, tc := range []struct {
		name    string
		reply   string
		n       int
		want    map[int]engine.Totals
		refused int
	}{
		{"all", "1 2 3 1 5 6 7 8 9 2 11 12", 2, map[int]engine.Totals{0: tot(1, 2, 3, 1, 5, 6), 1: tot(7, 8, 9, 2, 11, 12)}, 0},
		{"one refused", "e 5 6 7 8 9 10 e", 3, map[int]engine.Totals{1: tot(5, 6, 7, 8, 9, 10)}, 2},
		{"huge values", "9007199254740991 0 1 9007199254740991 0 9007199254740991", 1,
			map[int]engine.Totals{0: tot(engine.MaxCount, 0, 1, engine.MaxCount, 0, engine.MaxCount)}, 0},
		{"malformed", "1 2 3 4 5 6 7 x 9 10 11 12", 3, map[int]engine.Totals{0: tot(1, 2, 3, 4, 5, 6)}, 0},
		{"short", "1 2 3 4 5", 1, map[int]engine.Totals{}, 0},
		{"empty", "", 2, map[int]engine.Totals{}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := map[int]engine.Totals{}
			refused := parseMany(tc.reply, tc.n, func(i int, v engine.Totals) { got[i] = v })
			if refused != tc.refused || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("parseMany(%q) = %v, refused %d; want %v, refused %d", tc.reply, got, refused, tc.want, tc.refused)
			}
		})
	}
}

func TestTotalsOf_NamesTheScriptsNumbers(t *testing.T) {
	got := totalsOf([6]int64{10, 20, 3, 2, 40, 50})
	want := engine.Totals{Cur: 10, Prev: 20, Mine: 3, Shared: true, Processes: 2, Global: 40, GlobalPrev: 50}
	if got != want {
		t.Fatalf("totalsOf = %+v, want %+v", got, want)
	}
	if totalsOf([6]int64{1, 0, 1, 1, 0, 0}).Shared {
		t.Fatal("one record is not shared")
	}
}

func TestAppendCellKeys_MatchesTheKeysOfOneCell(t *testing.T) {
	k := engine.Key{Namespace: "api", Identifier: "a b:{c}%", Window: time.Minute}
	cur, prev := cellKeys(DefaultPrefix, k, 42)
	next, _ := cellKeys(DefaultPrefix, k, 43)
	for _, c := range []struct {
		f    cellFlags
		want []string
	}{
		{0, []string{cur, "", ""}},
		{withPrev, []string{cur, prev, ""}},
		{markNext, []string{cur, "", next}},
		{withPrev | markNext, []string{cur, prev, next}},
	} {
		b, ends := appendCellKeys([]byte("xyz"), DefaultPrefix, k, 42, c.f)
		got := []string{string(b[3:ends[0]]), string(b[ends[0]:ends[1]]), string(b[ends[1]:ends[2]])}
		if !reflect.DeepEqual(got, c.want) || ends[2] != len(b) {
			t.Fatalf("flags %d: keys %q (ends %v, len %d), want %q", c.f, got, ends, len(b), c.want)
		}
	}
}

// BenchmarkParseMany reads the reply of a full chunk of warm cells.
func BenchmarkParseMany(b *testing.B) {
	var fields []string
	for i := range manyChunk {
		fields = append(fields, strconv.Itoa(123456+i), "98765", strconv.Itoa(40+i), "2", "0", "0")
	}
	reply := strings.Join(fields, " ")
	var sum int64
	for b.Loop() {
		parseMany(reply, manyChunk, func(_ int, t engine.Totals) { sum += t.Cur })
	}
	if sum == 0 {
		b.Fatal("no cell read")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*manyChunk), "ns/cell")
}
