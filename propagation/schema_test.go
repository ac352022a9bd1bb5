package propagation

import (
	"os"
	"strings"
	"testing"
)

// TestSchema_READMEShowsTheStatements: operators with mysql_migrate off
// apply the README's statements, so each of the schema's and the
// upgrade's statements stands there as the migration runs it.
func TestSchema_READMEShowsTheStatements(t *testing.T) {
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	for _, stmt := range append(SchemaSQL(), UpgradeSQL()...) {
		if !strings.Contains(readme, stmt+";") {
			first, _, _ := strings.Cut(stmt, "\n")
			t.Errorf("README lacks the statement beginning %q (as the migration runs it, with a semicolon)", first)
		}
	}
}
