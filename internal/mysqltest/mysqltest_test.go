package mysqltest

import (
	"os"
	"testing"
)

var shared Shared

func TestMain(m *testing.M) { os.Exit(Main(m, &shared)) }

// TestServer_DatabasesAreApart: two databases of one server hold their
// own tables.
func TestServer_DatabasesAreApart(t *testing.T) {
	s := shared.Get(t)
	a, b := Open(t, s.NewDatabase(t)), Open(t, s.NewDatabase(t))
	if _, err := a.Exec(`CREATE TABLE t (x INT)`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Exec(`SELECT COUNT(*) FROM t`); err == nil {
		t.Fatal("database b sees a's table")
	}
}
