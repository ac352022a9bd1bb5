package origin

import (
	"reflect"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

func TestParseMany_ReadsCellsInOrderAndStopsAtAMalformedReply(t *testing.T) {
	for _, tc := range []struct {
		name    string
		reply   string
		n       int
		want    map[int][4]int64
		refused int
	}{
		{"all", "1 2 3 4 5 6 7 8", 2, map[int][4]int64{0: {1, 2, 3, 4}, 1: {5, 6, 7, 8}}, 0},
		{"one refused", "e 5 6 7 8 e", 3, map[int][4]int64{1: {5, 6, 7, 8}}, 2},
		{"huge values", "9007199254740991 0 1 9007199254740991", 1, map[int][4]int64{0: {engine.MaxCount, 0, 1, engine.MaxCount}}, 0},
		{"malformed", "1 2 3 4 5 x 7 8 9 10 11 12", 3, map[int][4]int64{0: {1, 2, 3, 4}}, 0},
		{"short", "1 2 3", 1, map[int][4]int64{}, 0},
		{"empty", "", 2, map[int][4]int64{}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := map[int][4]int64{}
			refused := parseMany(tc.reply, tc.n, func(i int, v [4]int64) { got[i] = v })
			if refused != tc.refused || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("parseMany(%q) = %v, refused %d; want %v, refused %d", tc.reply, got, refused, tc.want, tc.refused)
			}
		})
	}
}

func TestAppendWriteKeys_MatchesTheKeysOfOneCell(t *testing.T) {
	k := engine.Key{Namespace: "api", Identifier: "a b:{c}%", Window: time.Minute}
	b, ends := appendWriteKeys([]byte("xyz"), DefaultPrefix, k, 42)
	cur, prev := cellKeys(DefaultPrefix, k, 42)
	got := []string{string(b[3:ends[0]]), string(b[ends[0]:ends[1]]), string(b[ends[1]:ends[2]])}
	if want := []string{cur, contributionKey(cur), prev}; !reflect.DeepEqual(got, want) || ends[2] != len(b) {
		t.Fatalf("keys %q (ends %v, len %d), want %q", got, ends, len(b), want)
	}
}
