package ratelimit

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseLine runs one option line over its arguments.
func parseLine(l optionLine, args string) (*App, error) {
	d := caddyfile.NewTestDispenser(l.name + " " + args)
	d.Next()
	a := new(App)
	return a, l.parse(d, a)
}

// TestOptions_OneParserPerKindOfValue: every line of a kind of value is
// read and bounded the same way, and its error names the line and what it
// wants.
func TestOptions_OneParserPerKindOfValue(t *testing.T) {
	var gotDur time.Duration
	var gotInt int
	var gotRatio float64
	var gotOn *bool
	dur := durationLine("d", 10*time.Millisecond, func(_ *App, v time.Duration) { gotDur = v })
	count := intLine("n", 1, 5, func(_ *App, v int) { gotInt = v })
	open := intLine("m", 2, 0, func(_ *App, v int) { gotInt = v })
	ratio := ratioLine("r", func(_ *App, v float64) { gotRatio = v })
	sw := switchLine("s", func(_ *App, on bool) { gotOn = &on })
	for _, tc := range []struct {
		line    optionLine
		args    string
		wantErr string
	}{
		{dur, "250ms", ""},
		{dur, "5ms", `d: want a duration of at least 10ms, such as 1s, got "5ms"`},
		{dur, "soon", `d: want a duration of at least 10ms`},
		{dur, "", "wrong argument count"},
		{dur, "1s 2s", "wrong argument count"},
		{durationLine("tiny", 0, func(*App, time.Duration) {}), "500us", "at least 1ms"},
		{count, "5", ""},
		{count, "6", `n: want an integer from 1 to 5, got "6"`},
		{count, "x", `n: want an integer from 1 to 5`},
		{open, "2", ""},
		{open, "1", `m: want an integer of at least 2, got "1"`},
		{ratio, "0.5", ""},
		{ratio, "0", `r: want a ratio in (0, 1], got "0"`},
		{ratio, "1.5", `r: want a ratio in (0, 1]`},
		{sw, "off", ""},
		{sw, "maybe", `s: want on or off, got "maybe"`},
		{flagLine("f", func(*App) {}), "extra", "wrong argument count"},
	} {
		_, err := parseLine(tc.line, tc.args)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s %s: %v", tc.line.name, tc.args, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s %s: error %v, want %q", tc.line.name, tc.args, err, tc.wantErr)
		}
	}
	if gotDur != 250*time.Millisecond || gotInt != 2 || gotRatio != 0.5 || gotOn == nil || *gotOn {
		t.Fatalf("values stored: %v %v %v %v", gotDur, gotInt, gotRatio, gotOn)
	}
}

// TestOptions_EveryBackendLineIsKnown: the global option knows the app's
// lines and every backend kind's, each under one name.
func TestOptions_EveryBackendLineIsKnown(t *testing.T) {
	lines := optionLines()
	n := len(appLines)
	for _, k := range backendKinds {
		n += len(k.lines)
	}
	if len(lines) != n {
		t.Fatalf("%d distinct lines of %d declared: two lines share a name", len(lines), n)
	}
	for _, name := range []string{"region", "max_entries", "redis", "fast_tick", "mysql", "mysql_flush", "denial_gossip"} {
		if _, ok := lines[name]; !ok {
			t.Errorf("line %q unknown", name)
		}
	}
}

// TestOptions_ChecksRunAfterTheValueIsStored: a check across lines names
// the line that made the settings wrong.
func TestOptions_ChecksRunAfterTheValueIsStored(t *testing.T) {
	d := caddyfile.NewTestDispenser("ratelimit {\n\tredis redis://a\n\tredis_cluster b:1\n}")
	err := new(App).UnmarshalCaddyfile(d)
	if err == nil || !strings.Contains(err.Error(), "set only one of redis, redis_cluster and redis_sentinel") || !strings.Contains(err.Error(), ":3") {
		t.Fatalf("error %v, want the conflict at line 3", err)
	}
}

// TestOptions_LineGivenInTwoBlocks: a second global block adds to the
// first, but a line given in both is an error at the second, as it is
// within one block, not the last value silently winning. Lines of
// different names still add up across blocks.
func TestOptions_LineGivenInTwoBlocks(t *testing.T) {
	for _, tc := range []struct{ name, first, second string }{
		{"region", "region eu", "region us"},
		{"same value", "region eu", "region eu"},
		{"max_entries", "max_entries 5", "max_entries 7"},
		{"flag", "log_identifiers", "log_identifiers"},
		{"origin tunable", "redis redis://a\n\t\tread_timeout 1s", "read_timeout 2s"},
		{"switch off", "mysql \"u:p@tcp(h:1)/db\"\n\t\tregion eu\n\t\tmysql_migrate off", "mysql_migrate on"},
		{"sentinel", "redis_sentinel m a:1", "redis_sentinel n b:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := "{\n\tratelimit {\n\t\t" + tc.first + "\n\t}\n\tratelimit {\n\t\t" + tc.second + "\n\t}\n}\n:80 {\n\trespond ok\n}\n"
			line := strings.Count(src[:strings.LastIndex(src, tc.second)], "\n") + 1
			out, err := adapt(t, src)
			want := "given twice"
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "Caddyfile:"+strconv.Itoa(line)) {
				t.Fatalf("adapted to %s, error %v; want %q at Caddyfile:%d", out, err, want, line)
			}
		})
	}

	src := "{\n\tratelimit {\n\t\tregion eu\n\t\tredis redis://a\n\t}\n\tratelimit {\n\t\tredis redis://b\n\t\tread_timeout 1s\n\t\tmysql \"u:p@tcp(h:1)/db\"\n\t}\n}\n:80 {\n\trespond ok\n}\n"
	out, err := adapt(t, src)
	if err != nil {
		t.Fatalf("blocks of different lines: %v", err)
	}
	for _, want := range []string{`"region":"eu"`, `"redis":["redis://a","redis://b"]`, `"read_timeout":1000000000`, `"dsn":"u:p@tcp(h:1)/db"`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("adapted %s, want %s in it", out, want)
		}
	}
}

// TestCaddyfile_EmptyValueIsAnError: a value given empty ("" or a quoted
// "{$VAR}" whose variable is not set) fails at its line. Before, most lines
// took it for the line left out: `identifier_secret "{$SECRET}"` without
// SECRET set adapted to no secret at all, and identifiers left the process
// raw (Redis keys, MySQL rows, admin output); `cost ""` charged 1; `key ""`
// said "missing key" at the zone's line.
func TestCaddyfile_EmptyValueIsAnError(t *testing.T) {
	t.Setenv("RATELIMIT_TEST_UNSET", "")
	global := func(line string) string {
		return "{\n\tratelimit {\n\t\tredis rediss://a\n\t\t" + line + "\n\t}\n}\n:80 {\n\trespond ok\n}\n"
	}
	zone := func(line string) string {
		return ":80 {\n\tratelimit {\n\t\tzone z {\n\t\t\tkey {remote_host}\n\t\t\tlimit 5\n\t\t\twindow 1m\n\t\t\t" + line + "\n\t\t}\n\t}\n}\n"
	}
	handler := func(line string) string {
		return ":80 {\n\tratelimit {\n\t\tzone z {\n\t\t\tkey {remote_host}\n\t\t\tlimit 5\n\t\t\twindow 1m\n\t\t}\n\t\t" + line + "\n\t}\n}\n"
	}
	for _, tc := range []struct {
		src  string
		line int
	}{
		{global(`identifier_secret ""`), 4},
		{global(`identifier_secret "{$RATELIMIT_TEST_UNSET}"`), 4},
		{global(`region ""`), 4},
		{global(`tls_ca_file ""`), 4},
		{zone(`cost ""`), 7},
		{zone(`cost {http.request.header.C} ""`), 7},
		{strings.Replace(zone(`min_cost 1`), "key {remote_host}", `key ""`, 1), 4},
		{handler(`headers ""`), 8},
		{handler(`on_missing_key ""`), 8},
	} {
		out, err := adapt(t, tc.src)
		at := "Caddyfile:" + strconv.Itoa(tc.line)
		if err == nil || !strings.Contains(err.Error(), "empty") || !strings.Contains(err.Error(), at) {
			t.Errorf("%s\nadapted to %s, error %v; want an empty value at %s", tc.src, out, err, at)
		}
	}
}
