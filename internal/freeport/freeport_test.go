package freeport

import (
	"bufio"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"testing"
)

func TestPort_DistinctFreeAndBelowTheEphemeralRange(t *testing.T) {
	seen := map[int]bool{}
	for range 100 {
		p, err := Port()
		if err != nil {
			t.Fatal(err)
		}
		if seen[p] {
			t.Fatalf("port %d handed out twice", p)
		}
		seen[p] = true
		if lock != nil && (p < lowest || p >= top) {
			t.Fatalf("port %d outside [%d, %d)", p, lowest, top)
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			t.Fatalf("port %d is not free: %v", p, err)
		}
		l.Close()
	}
}

// The child of TestPort_OtherProcessesCannotTakeIt: it prints the ports it
// was handed and holds them until its input closes.
func TestMain(m *testing.M) {
	if os.Getenv("FREEPORT_CHILD") == "1" {
		for range 20 {
			p, err := Port()
			if err != nil {
				os.Exit(2)
			}
			os.Stdout.WriteString(strconv.Itoa(p) + "\n")
		}
		os.Stdout.WriteString("held\n")
		io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestPort_OtherProcessesCannotTakeIt(t *testing.T) {
	if _, err := Port(); err != nil { // opens this process's lock file
		t.Fatal(err)
	}
	if lock == nil {
		t.Skip("no room below the ephemeral range here: ports are the kernel's")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FREEPORT_CHILD=1")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var ports []int
	sc := bufio.NewScanner(out)
	for sc.Scan() && sc.Text() != "held" {
		p, err := strconv.Atoi(sc.Text())
		if err != nil {
			t.Fatalf("child said %q", sc.Text())
		}
		ports = append(ports, p)
	}
	if len(ports) != 20 {
		t.Fatalf("child handed out %d ports, want 20", len(ports))
	}
	mu.Lock()
	for _, p := range ports {
		if tryLock(p) {
			t.Errorf("port %d, held by the child, was free to lock here", p)
		}
	}
	mu.Unlock()
	in.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	// The child has ended: the kernel dropped its locks.
	mu.Lock()
	defer mu.Unlock()
	for _, p := range ports {
		if !tryLock(p) {
			t.Errorf("port %d still locked after the child ended", p)
		}
	}
}
