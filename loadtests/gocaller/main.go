// Command gocaller calls a webhook the way the kube-apiserver does, with Go's own net/http client
// configured as client-go configures it for webhooks, and reports every review for the Python
// load tests (loadtests/gocaller.py) to summarise.
//
// The connection policy is Go's http.Transport, not a model of it: keep-alive HTTP/1.1 over TLS,
// at most 25 idle connections per host (client-go's transport/cache.go), a new connection dialled
// whenever none is idle with no upper bound, full TLS handshakes (no session cache), a
// 10 s handshake timeout. Each review is cancelled at its deadline (the review's ?timeout=,
// counted from its scheduled arrival), and Go closes a connection whose request it cancelled.
//
// Protocol with loadtests/gocaller.py: it warms its connections up (-warmup seconds of closed
// loop over 8 callers), prints "warm", and reads one command from stdin: "schedule FILE" (an open
// loop at the arrival offsets in FILE, seconds, one per line) or "closed N SECONDS" (N callers in
// a closed loop). It prints "measuring" as the measured phase starts and writes the result to
// -out as one JSON document. End of input instead of a command: it exits without measuring.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"regexp"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const placeholder = "ffffffff-ffff-4fff-bfff-ffffffffffff"

type reply struct {
	Response *struct {
		UID              string            `json:"uid"`
		Allowed          bool              `json:"allowed"`
		AuditAnnotations map[string]string `json:"auditAnnotations"`
	} `json:"response"`
}

// Outcome codes, shared with loadtests/gocaller.py.
const (
	answered   = 0 // allowed, in time
	failedOpen = 1 // allowed in time, with failed-open annotations
	abandoned  = 2 // no answer before the deadline (the request was cancelled)
	lost       = 3 // the connection failed (dial, handshake, reset)
	wrong      = 4 // an answer, but not a 200 with this review's UID allowed
)

type result struct {
	Due     []float64      `json:"due"`
	Latency []float64      `json:"latency"` // -1: no answer in time
	Code    []int8         `json:"code"`
	Lag     []float64      `json:"lag"`
	Errors  map[string]int `json:"errors"`
	Dials   []float64      `json:"dials"` // when each new connection's handshake completed
	Stats   map[string]int `json:"stats"`
	// Why dials failed, by error message (at most 20 distinct messages; the rest as "other").
	DialErrors map[string]int `json:"dial_errors"`
	Seconds    float64        `json:"seconds"`
	Reviews    int            `json:"reviews"`
	CPUUser    float64        `json:"cpu_user_s"`
	CPUSys     float64        `json:"cpu_sys_s"`
	Warmed     int            `json:"warmed"`
	HTTP2      bool           `json:"http2"`
	Protocol   string         `json:"protocol"`
}

type caller struct {
	client  *http.Client
	url     string
	prefix  []byte
	suffix  []byte
	timeout time.Duration
	counter atomic.Uint64

	mu     sync.Mutex
	origin time.Time
	res    *result
	proto  atomic.Value

	dials, opened, dialErrors, reused, closedAbandoned atomic.Int64
	open, peakOpen, dialMicros                         atomic.Int64 // TCP connections open now, the most at once, dial time of completed dials
}

// countedConn is a dialled TCP connection that counts itself out of caller.open when closed.
type countedConn struct {
	net.Conn
	c    *caller
	once sync.Once
}

func (k *countedConn) Close() error {
	k.once.Do(func() { k.c.open.Add(-1) })
	return k.Conn.Close()
}

// dial is the transport's DialContext: a net.Dialer's, with every connection counted while open.
func (c *caller) dial(dialer *net.Dialer) func(context.Context, string, string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		now := c.open.Add(1)
		for peak := c.peakOpen.Load(); now > peak && !c.peakOpen.CompareAndSwap(peak, now); peak = c.peakOpen.Load() {
		}
		return &countedConn{Conn: conn, c: c}, nil
	}
}

func (c *caller) body(uid string) []byte {
	b := make([]byte, 0, len(c.prefix)+len(uid)+len(c.suffix))
	b = append(b, c.prefix...)
	b = append(b, uid...)
	return append(b, c.suffix...)
}

var addrPort = regexp.MustCompile(`(\d+\.\d+\.\d+\.\d+|\[[0-9a-f:]+\]):\d+`)

// dialFailed counts a failed TCP connect or TLS handshake, by its message.
func (c *caller) dialFailed(err error) {
	c.dialErrors.Add(1)
	c.mu.Lock()
	defer c.mu.Unlock()
	msg := addrPort.ReplaceAllString(err.Error(), "$1:PORT")
	if _, seen := c.res.DialErrors[msg]; !seen && len(c.res.DialErrors) >= 20 {
		msg = "other"
	}
	c.res.DialErrors[msg]++
}

// call sends one review due at `due` and records what came back (record=false: warm-up).
func (c *caller) call(due time.Time, record bool) {
	n := c.counter.Add(1)
	uid := fmt.Sprintf("0ad0ad00-0000-4000-8000-%012x", n)
	lag := time.Since(due).Seconds()
	ctx, cancel := context.WithDeadline(context.Background(), due.Add(c.timeout))
	defer cancel()
	gotConn := false
	var dialStarted time.Time // of the dial this review started, if any (its hooks run in turn)
	trace := &httptrace.ClientTrace{
		ConnectDone: func(_, _ string, err error) {
			if record && err != nil {
				c.dialFailed(err)
			}
		},
		ConnectStart: func(string, string) {
			dialStarted = time.Now()
			if record {
				c.dials.Add(1)
			}
		},
		TLSHandshakeDone: func(_ tls.ConnectionState, err error) {
			if !record {
				return
			}
			if err != nil {
				c.dialFailed(err)
				return
			}
			c.opened.Add(1)
			if !dialStarted.IsZero() {
				c.dialMicros.Add(time.Since(dialStarted).Microseconds())
			}
			c.mu.Lock()
			c.res.Dials = append(c.res.Dials, time.Since(c.origin).Seconds())
			c.mu.Unlock()
		},
		GotConn: func(info httptrace.GotConnInfo) {
			gotConn = true
			if record && info.Reused {
				c.reused.Add(1)
			}
		},
	}
	req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, c.url, bytes.NewReader(c.body(uid)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, */*")
	code, kind := answered, ""
	resp, err := c.client.Do(req)
	var latency float64 = -1
	if err == nil {
		c.proto.Store(resp.Proto)
		data, rerr := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
		resp.Body.Close()
		switch {
		case rerr != nil && ctx.Err() != nil:
			code = abandoned
		case rerr != nil:
			code, kind = lost, "connection-lost"
		default:
			latency = time.Since(due).Seconds()
			var r reply
			if resp.StatusCode != http.StatusOK {
				code, kind = wrong, "http-"+strconv.Itoa(resp.StatusCode)
			} else if json.Unmarshal(data, &r) != nil || r.Response == nil || r.Response.UID != uid || !r.Response.Allowed {
				code, kind = wrong, "wrong-answer"
			} else {
				for k := range r.Response.AuditAnnotations {
					if strings.HasPrefix(k, "failed-open.") {
						code = failedOpen
						break
					}
				}
			}
			if code == wrong {
				latency = -1
			}
		}
	} else if ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) {
		code = abandoned
	} else {
		code, kind = lost, "connection-lost"
	}
	if code == abandoned && gotConn && record {
		c.closedAbandoned.Add(1)
	}
	if !record {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.res.Due = append(c.res.Due, due.Sub(c.origin).Seconds())
	c.res.Latency = append(c.res.Latency, latency)
	c.res.Code = append(c.res.Code, int8(code))
	c.res.Lag = append(c.res.Lag, lag)
	if kind != "" {
		c.res.Errors[kind]++
	}
}

func closedLoop(c *caller, workers int, seconds float64, record bool) {
	end := time.Now().Add(time.Duration(seconds * float64(time.Second)))
	var wg sync.WaitGroup
	for i := 0; i < workers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				c.call(time.Now(), record)
			}
		}()
	}
	wg.Wait()
}

func openLoop(c *caller, offsets []float64) {
	var wg sync.WaitGroup
	for _, off := range offsets {
		due := c.origin.Add(time.Duration(off * float64(time.Second)))
		if d := time.Until(due); d > 0 {
			time.Sleep(d)
		}
		wg.Add(1)
		go func(due time.Time) {
			defer wg.Done()
			c.call(due, true)
		}(due)
	}
	wg.Wait()
}

func readSchedule(path string) ([]float64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []float64
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		v, err := strconv.ParseFloat(line, 64)
		if err != nil {
			return nil, fmt.Errorf("%s: %q: %w", path, line, err)
		}
		out = append(out, v)
	}
	return out, sc.Err()
}

func cpuSeconds() (float64, float64) {
	var ru syscallRusage
	getrusage(&ru)
	return ru.user, ru.sys
}

func main() {
	url := flag.String("url", "", "the webhook URL, with its ?timeout=")
	caPath := flag.String("ca", "", "PEM file of the CA that signed the webhook's certificate")
	bodyPath := flag.String("body", "", "the AdmissionReview to send, with the UID "+placeholder)
	timeout := flag.Float64("timeout", 2, "seconds from a review's scheduled arrival to its deadline")
	warmup := flag.Float64("warmup", 1, "seconds of closed loop over 8 callers first, not recorded")
	maxIdle := flag.Int("max-idle", 25, "idle connections kept per host (client-go: 25)")
	http2 := flag.Bool("http2", false, "allow HTTP/2 (the apiserver does for https://localhost and 127.0.0.1 only)")
	out := flag.String("out", "", "where to write the JSON result")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the measured phase here (go tool pprof)")
	flag.Parse()
	if *url == "" || *caPath == "" || *bodyPath == "" || *out == "" {
		fmt.Fprintln(os.Stderr, "gocaller: -url, -ca, -body and -out are required")
		os.Exit(2)
	}
	pem, err := os.ReadFile(*caPath)
	fail(err)
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		fail(fmt.Errorf("%s: no PEM certificate", *caPath))
	}
	body, err := os.ReadFile(*bodyPath)
	fail(err)
	parts := bytes.SplitN(body, []byte(placeholder), 2)
	if len(parts) != 2 {
		fail(fmt.Errorf("%s: no UID %s to replace", *bodyPath, placeholder))
	}
	// client-go's webhook transport: utilnet.SetTransportDefaults over this http.Transport.
	c := &caller{
		url:     *url,
		prefix:  parts[0],
		suffix:  parts[1],
		timeout: time.Duration(*timeout * float64(time.Second)),
		res:     &result{Errors: map[string]int{}, Dials: []float64{}, DialErrors: map[string]int{}},
	}
	transport := &http.Transport{
		DialContext:         c.dial(&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}),
		TLSClientConfig:     &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout: 10 * time.Second,
		MaxIdleConnsPerHost: *maxIdle,
		IdleConnTimeout:     90 * time.Second,
		ForceAttemptHTTP2:   *http2,
	}
	if !*http2 {
		transport.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	c.client = &http.Client{Transport: transport}
	if *warmup > 0 {
		closedLoop(c, 8, *warmup, false)
	}
	fmt.Println("warm")
	command, err := bufio.NewReader(os.Stdin).ReadString('\n')
	if err == io.EOF && command == "" {
		return
	}
	fail(err)
	var offsets []float64
	closed, seconds := 0, 0.0
	switch fields := strings.Fields(command); {
	case len(fields) == 2 && fields[0] == "schedule":
		offsets, err = readSchedule(fields[1])
		fail(err)
	case len(fields) == 3 && fields[0] == "closed":
		closed, err = strconv.Atoi(fields[1])
		fail(err)
		seconds, err = strconv.ParseFloat(fields[2], 64)
		fail(err)
	default:
		fail(fmt.Errorf("unknown command %q (want \"schedule FILE\" or \"closed N SECONDS\")", command))
	}
	u0, s0 := cpuSeconds()
	c.origin = time.Now()
	c.peakOpen.Store(c.open.Load()) // the measured phase's peak: from what the warm-up left open
	fmt.Println("measuring")        // the Python side takes its own readings from here
	if *cpuProfile != "" {
		pf, err := os.Create(*cpuProfile)
		fail(err)
		fail(pprof.StartCPUProfile(pf))
		defer pprof.StopCPUProfile()
	}
	if closed > 0 {
		closedLoop(c, closed, seconds, true)
	} else {
		openLoop(c, offsets)
	}
	c.res.Seconds = time.Since(c.origin).Seconds()
	u1, s1 := cpuSeconds()
	c.res.CPUUser, c.res.CPUSys = u1-u0, s1-s0
	c.res.Reviews = len(c.res.Due)
	c.res.Stats = map[string]int{
		"dials":            int(c.dials.Load()),
		"opened":           int(c.opened.Load()),
		"dial_errors":      int(c.dialErrors.Load()),
		"reused":           int(c.reused.Load()),
		"closed_abandoned": int(c.closedAbandoned.Load()),
		"peak_open":        int(c.peakOpen.Load()),
		"dial_us_total":    int(c.dialMicros.Load()),
	}
	c.res.HTTP2 = *http2
	if p, ok := c.proto.Load().(string); ok {
		c.res.Protocol = p
	}
	transport.CloseIdleConnections()
	for i, l := range c.res.Latency {
		if math.IsNaN(l) {
			c.res.Latency[i] = -1
		}
	}
	f, err := os.Create(*out)
	fail(err)
	defer f.Close()
	buf := bufio.NewWriter(f)
	fail(json.NewEncoder(buf).Encode(c.res))
	fail(buf.Flush())
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "gocaller:", err)
		os.Exit(2)
	}
}
