package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// adminIf sends a change with one header (If-Match, If-None-Match) set.
func adminIf(t *testing.T, admin int, method, path, body, header, value string) adminReply {
	t.Helper()
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", admin, path), strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(header, value)
	status, h, b := roundTrip(t, http.DefaultClient, req)
	return adminReply{status: status, header: h, body: b}
}

// wantSays fails unless the reply is a JSON error with the status whose
// message says says.
func (r adminReply) wantSays(t *testing.T, status int, says string) {
	t.Helper()
	var e struct {
		Error string `json:"error"`
	}
	if err := json.Unmarshal(r.body, &e); r.status != status || err != nil || !strings.Contains(e.Error, says) {
		t.Fatalf("%d %s, want a %d saying %s", r.status, bytes.TrimSpace(r.body), status, says)
	}
}

// wantOverride fails unless the node's GET of the override shows limit
// under etag.
func wantOverride(t *testing.T, admin int, path string, limit int64, etag string) {
	t.Helper()
	var doc overrideDoc
	r := adminDo(t, admin, http.MethodGet, path)
	r.decode(t, http.StatusOK, &doc)
	if doc.Limit != limit || doc.ETag != etag || r.header.Get("ETag") != etag {
		t.Fatalf("the node holds limit %d as %s (header %s), want %d as %s", doc.Limit, doc.ETag, r.header.Get("ETag"), limit, etag)
	}
}

// TestOverrides_ChangesHonourIfMatchAndIfNoneMatch: every answer about one
// override carries its ETag (the header and the doc's etag agree); a
// change whose If-Match does not name the override held, or whose
// If-None-Match: * finds one, is a 412 that changes nothing, and one that
// names it takes.
func TestOverrides_ChangesHonourIfMatchAndIfNoneMatch(t *testing.T) {
	resetOverrides(t)
	_, admin, base := startCaddy(t, overrideConfig(""))
	const path = "/ratelimit/overrides?zone=ov&identifier=k"

	adminIf(t, admin, http.MethodPut, path, `{"limit": 3}`, "If-Match", "*").
		wantSays(t, http.StatusPreconditionFailed, "no live override")
	if n := overrides.active(); n != 0 {
		t.Fatalf("If-Match: * with no override stored %d", n)
	}
	var first overrideDoc
	r := adminIf(t, admin, http.MethodPut, path, `{"limit": 3}`, "If-None-Match", "*")
	r.decode(t, http.StatusOK, &first)
	if first.ETag == "" || r.header.Get("ETag") != first.ETag {
		t.Fatalf("the PUT's ETag header is %q, its doc's etag %q", r.header.Get("ETag"), first.ETag)
	}
	// The 412 says what * asked for: it said the header named the tag.
	taken := adminIf(t, admin, http.MethodPut, path, `{"limit": 4}`, "If-None-Match", "*")
	taken.wantSays(t, http.StatusPreconditionFailed, first.ETag)
	taken.wantSays(t, http.StatusPreconditionFailed, "* asks that there be no live override")
	wantOverride(t, admin, path, 3, first.ETag)

	var second overrideDoc
	adminIf(t, admin, http.MethodPut, path, `{"limit": 5}`, "If-Match", first.ETag).decode(t, http.StatusOK, &second)
	if second.ETag == first.ETag {
		t.Fatalf("a change kept the ETag %s", first.ETag)
	}
	// The first operator's tag is stale now, also among others, and a
	// weak tag never matches If-Match.
	for _, stale := range []string{first.ETag, `"1", ` + first.ETag, "W/" + second.ETag} {
		adminIf(t, admin, http.MethodPut, path, `{"limit": 6}`, "If-Match", stale).
			wantSays(t, http.StatusPreconditionFailed, second.ETag)
		adminIf(t, admin, http.MethodDelete, path, "", "If-Match", stale).
			wantSays(t, http.StatusPreconditionFailed, second.ETag)
	}
	adminIf(t, admin, http.MethodDelete, path, "", "If-None-Match", second.ETag).
		wantSays(t, http.StatusPreconditionFailed, second.ETag)
	wantOverride(t, admin, path, 5, second.ETag)
	if n := admitted(t, base, "k", 6); n != 5 {
		t.Fatalf("the override of 5 admitted %d of 6", n)
	}

	// A GET whose If-None-Match names the override is a 304.
	r = adminIf(t, admin, http.MethodGet, path, "", "If-None-Match", `W/`+second.ETag)
	if r.status != http.StatusNotModified || r.header.Get("ETag") != second.ETag || len(r.body) != 0 {
		t.Fatalf("GET If-None-Match of the override held: %d, ETag %q, body %q", r.status, r.header.Get("ETag"), r.body)
	}
	adminIf(t, admin, http.MethodGet, path, "", "If-None-Match", first.ETag).decode(t, http.StatusOK, &overrideDoc{})

	var gone overrideDoc
	r = adminIf(t, admin, http.MethodDelete, path, "", "If-Match", `"1", `+second.ETag)
	r.decode(t, http.StatusOK, &gone)
	if !gone.Removed || gone.ETag == second.ETag || r.header.Get("ETag") != gone.ETag {
		t.Fatalf("DELETE answered %+v, ETag header %q", gone, r.header.Get("ETag"))
	}
	adminIf(t, admin, http.MethodPut, path, `{"limit": 1}`, "If-Match", gone.ETag).
		wantSays(t, http.StatusPreconditionFailed, "no live override")
	// With nothing to remove, a DELETE is a 404 whatever it is made on.
	adminIf(t, admin, http.MethodDelete, path, "", "If-Match", "*").wantSays(t, http.StatusNotFound, "no runtime override")
	if n := overrides.active(); n != 0 {
		t.Fatalf("%d overrides left after the removal", n)
	}
}

// TestOverrides_MalformedPreconditionsAreRefused: a malformed If-Match or
// If-None-Match is a 400 naming the header, as is one on a listing, and
// nothing is stored.
func TestOverrides_MalformedPreconditionsAreRefused(t *testing.T) {
	resetOverrides(t)
	_, admin, _ := startCaddy(t, overrideConfig(""))
	const path = "/ratelimit/overrides?zone=ov&identifier=k"
	cases := []struct{ method, path, header, value, says string }{
		{http.MethodPut, path, "If-Match", "abc", "If-Match is malformed"},
		{http.MethodPut, path, "If-Match", `"abc`, "If-Match is malformed"},
		{http.MethodPut, path, "If-Match", `"a b"`, "If-Match is malformed"},
		{http.MethodPut, path, "If-Match", `"a" "b"`, "If-Match is malformed"},
		{http.MethodPut, path, "If-Match", `*, "a"`, "If-Match is malformed"},
		{http.MethodPut, path, "If-Match", ` , `, "If-Match is malformed"},
		{http.MethodPut, path, "If-Match", "*x", "If-Match is malformed"},
		{http.MethodPut, path, "If-None-Match", "W/abc", "If-None-Match is malformed"},
		{http.MethodDelete, path, "If-Match", "1234", "If-Match is malformed"},
		{http.MethodGet, path, "If-None-Match", `"a`, "If-None-Match is malformed"},
		{http.MethodGet, "/ratelimit/overrides?zone=ov", "If-None-Match", "*", "a listing has no entity tag"},
	}
	for _, c := range cases {
		adminIf(t, admin, c.method, c.path, `{"limit": 1}`, c.header, c.value).wantSays(t, http.StatusBadRequest, c.says)
	}
	if n := overrides.active(); n != 0 {
		t.Fatalf("%d overrides stored after malformed preconditions", n)
	}
}

// TestOverrides_TwoConditionalChangesAtOnceOneWins: operators who read
// the same override and change it at once on one node, each with its
// ETag in If-Match, do not both win: exactly one change takes, the others
// are 412s, and the override is the winner's, in the node's book and in
// the region's Redis. The check and the change are one step on the node;
// checked apart, each request found the tag it read, and the last write
// won silently.
func TestOverrides_TwoConditionalChangesAtOnceOneWins(t *testing.T) {
	resetOverrides(t)
	srv := redistest.Start(t)
	global := fmt.Sprintf("\tratelimit {\n\t\tregion ov-test\n\t\tredis %s\n\t\tfast_tick 10ms\n\t}", srv.URL())
	other, _ := otherNode(t, srv)
	_, admin, _ := startCaddy(t, overrideConfig(global))
	const path = "/ratelimit/overrides?zone=ov&identifier=k"
	var read overrideDoc
	adminSend(t, admin, http.MethodPut, path, `{"limit": 1}`).decode(t, http.StatusOK, &read)

	const racers = 8
	statuses := make([]int, racers)
	errs := make([]error, racers)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, err := http.NewRequest(http.MethodPut, fmt.Sprintf("http://localhost:%d%s", admin, path),
				strings.NewReader(fmt.Sprintf(`{"limit": %d}`, 100+i)))
			if err != nil {
				errs[i] = err
				return
			}
			req.Header.Set("If-Match", read.ETag)
			<-start
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				errs[i] = err
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		}()
	}
	close(start)
	wg.Wait()
	winner := -1
	for i, s := range statuses {
		switch {
		case errs[i] != nil:
			t.Fatalf("request %d: %v", i, errs[i])
		case s == http.StatusOK && winner >= 0:
			t.Fatalf("requests %d and %d both took with If-Match %s: %v", winner, i, read.ETag, statuses)
		case s == http.StatusOK:
			winner = i
		case s != http.StatusPreconditionFailed:
			t.Fatalf("request %d: %d, want 200 or 412: %v", i, s, statuses)
		}
	}
	if winner < 0 {
		t.Fatalf("no request took: %v", statuses)
	}
	var doc overrideDoc
	adminDo(t, admin, http.MethodGet, path).decode(t, http.StatusOK, &doc)
	if doc.Limit != int64(100+winner) {
		t.Fatalf("the node holds limit %d, want the winner's %d", doc.Limit, 100+winner)
	}
	_, all, err := other.Overrides(context.Background())
	if err != nil || len(all) != 1 || !bytes.Contains([]byte(all[0].Value), []byte(fmt.Sprintf(`"limit":%d`, 100+winner))) {
		t.Fatalf("the region holds %+v (%v), want the winner's limit %d", all, err, 100+winner)
	}
}
