package testutil

import (
	"runtime"
	"strings"
)

// Goroutines counts the process's goroutines whose stack names frame (a
// substring of a function's name as a stack trace prints it, such as
// "objectsvc.(*Service).CallStream"): how a test sees that the goroutines
// a component started have stopped, where goleak would wait for all.
func Goroutines(frame string) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, frame) {
			count++
		}
	}
	return count
}
