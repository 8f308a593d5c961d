// Command gobackend is a validating admission webhook that allows every review, compiled: the load
// tests' backend when the Python fleet's CPU per call (as much as the gateway's own) would take the
// shared machine's CPUs from the gateway it measures (python -m loadtests … --backend go).
//
// It serves HTTPS on -count listeners with one certificate, offering h2 and http/1.1 in ALPN (only
// http/1.1 with -http1-only), and prints one JSON line {"scheme","host","ports"} once they listen,
// as python -m gateway.devtools.backends does. POST /allow answers
//
//	{"apiVersion":<the review's>,"kind":"AdmissionReview","response":{"uid":<request.uid>,"allowed":true}}
//
// for admission.k8s.io/v1 and v1beta1 reviews; POST /sleep/N/allow answers the same after N
// milliseconds (the overload scenario's 20 ms backends); a body that is not such a review gets HTTP
// 400, any other path 404, GET /healthz "ok". The review is not decoded: a scanner walks its JSON for the
// top-level "apiVersion" and "request"'s "uid" (nested values skipped whole, keys compared after
// unescaping, the last of duplicate keys wins as in encoding/json), so the uid is the request's for
// every valid JSON review at a fraction of a full decode's CPU.
package main

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

const maxBody = 16 << 20

var errSyntax = errors.New("not a JSON object")

// scanner walks one JSON document without decoding it.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) expect(c byte) error {
	s.ws()
	if s.i >= len(s.b) || s.b[s.i] != c {
		return errSyntax
	}
	s.i++
	return nil
}

// str returns the raw string token at the cursor, quotes included, and whether it has escapes.
func (s *scanner) str() ([]byte, bool, error) {
	s.ws()
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return nil, false, errSyntax
	}
	start, escaped := s.i, false
	s.i++
	for {
		j := bytes.IndexAny(s.b[s.i:], "\"\\")
		if j < 0 {
			return nil, false, errSyntax
		}
		s.i += j
		if s.b[s.i] == '"' {
			s.i++
			return s.b[start:s.i], escaped, nil
		}
		escaped = true
		s.i += 2 // the backslash and the byte it escapes (\uXXXX's hex digits are plain bytes)
		if s.i > len(s.b) {
			return nil, false, errSyntax
		}
	}
}

// skip passes over one value of any kind.
func (s *scanner) skip() error {
	s.ws()
	if s.i >= len(s.b) {
		return errSyntax
	}
	switch s.b[s.i] {
	case '"':
		_, _, err := s.str()
		return err
	case '{', '[':
		depth := 0
		for s.i < len(s.b) {
			switch s.b[s.i] {
			case '"':
				if _, _, err := s.str(); err != nil {
					return err
				}
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					s.i++
					return nil
				}
			}
			s.i++
		}
		return errSyntax
	default: // a number, true, false or null: up to the next delimiter
		start := s.i
		for s.i < len(s.b) {
			switch s.b[s.i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				if s.i == start {
					return errSyntax
				}
				return nil
			}
			s.i++
		}
		return errSyntax
	}
}

// keyIs reports whether the raw key token names `name`, unescaping it first when it has escapes.
func keyIs(raw []byte, escaped bool, name string) bool {
	if !escaped {
		return len(raw) == len(name)+2 && string(raw[1:len(raw)-1]) == name
	}
	var key string
	return json.Unmarshal(raw, &key) == nil && key == name
}

// object calls field for each member of the object at the cursor; field must consume the value.
func (s *scanner) object(field func(raw []byte, escaped bool) error) error {
	if err := s.expect('{'); err != nil {
		return err
	}
	s.ws()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return nil
	}
	for {
		raw, escaped, err := s.str()
		if err != nil {
			return err
		}
		if err := s.expect(':'); err != nil {
			return err
		}
		if err := field(raw, escaped); err != nil {
			return err
		}
		s.ws()
		if s.i >= len(s.b) {
			return errSyntax
		}
		switch s.b[s.i] {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return errSyntax
		}
	}
}

// reviewFields finds the review's top-level apiVersion (decoded) and request.uid (its raw JSON
// string token, which the answer repeats as it came: the same string once decoded).
func reviewFields(body []byte) (apiVersion string, uid []byte, err error) {
	s := &scanner{b: body}
	err = s.object(func(raw []byte, escaped bool) error {
		switch {
		case keyIs(raw, escaped, "apiVersion"):
			v, vesc, err := s.str()
			if err != nil {
				return err
			}
			if !vesc {
				apiVersion = string(v[1 : len(v)-1])
				return nil
			}
			return json.Unmarshal(v, &apiVersion)
		case keyIs(raw, escaped, "request"):
			s.ws()
			if s.i < len(s.b) && s.b[s.i] == 'n' { // "request": null
				uid = nil
				return s.skip()
			}
			uid = nil
			return s.object(func(raw []byte, escaped bool) error {
				if keyIs(raw, escaped, "uid") {
					v, _, err := s.str()
					uid = v
					return err
				}
				return s.skip()
			})
		default:
			return s.skip()
		}
	})
	if err == nil {
		s.ws()
		if s.i != len(s.b) {
			err = errSyntax
		}
	}
	return apiVersion, uid, err
}

var bodies = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func allow(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	buf := bodies.Get().(*bytes.Buffer)
	defer bodies.Put(buf)
	buf.Reset()
	if _, err := buf.ReadFrom(io.LimitReader(r.Body, maxBody+1)); err != nil {
		http.Error(w, "reading the body: "+err.Error(), http.StatusBadRequest)
		return
	}
	if buf.Len() > maxBody {
		http.Error(w, "body over 16 MiB", http.StatusRequestEntityTooLarge)
		return
	}
	version, uid, err := reviewFields(buf.Bytes())
	switch {
	case err != nil:
		http.Error(w, "not a JSON AdmissionReview", http.StatusBadRequest)
		return
	case version != "admission.k8s.io/v1" && version != "admission.k8s.io/v1beta1":
		http.Error(w, "not an admission.k8s.io/v1 or v1beta1 AdmissionReview", http.StatusBadRequest)
		return
	case uid == nil:
		http.Error(w, "no request.uid", http.StatusBadRequest)
		return
	}
	out := make([]byte, 0, 96+len(uid))
	out = append(out, `{"apiVersion":"`...)
	out = append(out, version...)
	out = append(out, `","kind":"AdmissionReview","response":{"uid":`...)
	out = append(out, uid...)
	out = append(out, `,"allowed":true}}`...)
	h := w.Header()
	h["Content-Type"] = []string{"application/json"}
	w.Write(out)
}

func main() {
	host := flag.String("host", "127.0.0.1", "address to listen on")
	count := flag.Int("count", 1, "number of listeners (one per backend), each on its own ephemeral port")
	certFile := flag.String("certfile", "", "PEM certificate chain")
	keyFile := flag.String("keyfile", "", "PEM private key")
	http1Only := flag.Bool("http1-only", false, "offer only http/1.1 in ALPN (no HTTP/2)")
	procs := flag.Int("procs", 1, "Go's GOMAXPROCS unless the environment sets it: one core, as the "+
		"Python fleet's one process (a second one, spinning while idle, cost more CPU per call: "+
		"loadtests/README.md)")
	flag.Parse()
	if os.Getenv("GOMAXPROCS") == "" && *procs > 0 {
		runtime.GOMAXPROCS(*procs)
	}
	if *certFile == "" || *keyFile == "" || *count < 1 {
		fmt.Fprintln(os.Stderr, "gobackend: -certfile and -keyfile are required, -count at least 1")
		os.Exit(2)
	}
	cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
	fail(err)
	mux := http.NewServeMux()
	mux.HandleFunc("/allow", allow)
	mux.HandleFunc("/sleep/", func(w http.ResponseWriter, r *http.Request) {
		ms, rest, ok := strings.Cut(strings.TrimPrefix(r.URL.Path, "/sleep/"), "/")
		n, err := strconv.ParseFloat(ms, 64)
		if !ok || rest != "allow" || err != nil || n < 0 || n > 60_000 {
			http.NotFound(w, r)
			return
		}
		time.Sleep(time.Duration(n * float64(time.Millisecond)))
		allow(w, r)
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })
	protos := []string{"h2", "http/1.1"}
	if *http1Only {
		protos = []string{"http/1.1"}
	}
	ports := make([]int, 0, *count)
	servers := make([]*http.Server, 0, *count)
	listeners := make([]net.Listener, 0, *count)
	for i := 0; i < *count; i++ {
		ln, err := net.Listen("tcp", net.JoinHostPort(*host, "0"))
		fail(err)
		srv := &http.Server{
			Handler:           mux,
			TLSConfig:         &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: protos, MinVersion: tls.VersionTLS12},
			ReadHeaderTimeout: 30 * time.Second,
			IdleTimeout:       120 * time.Second,
			ErrorLog:          log.New(io.Discard, "", 0), // handshakes the caller abandoned: not news
			// As the Python fleet's h2: 1,000 streams per connection (Go's default is 250: a gateway
			// with more calls in flight would queue them or dial), 1 MiB per stream.
			HTTP2: &http.HTTP2Config{
				MaxConcurrentStreams:          1000,
				MaxReceiveBufferPerStream:     1 << 20,
				MaxReceiveBufferPerConnection: 4<<20 - 1,
			},
		}
		if *http1Only {
			srv.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){} // no h2
		}
		ports = append(ports, ln.(*net.TCPListener).Addr().(*net.TCPAddr).Port)
		servers = append(servers, srv)
		listeners = append(listeners, ln)
	}
	line, err := json.Marshal(map[string]any{"scheme": "https", "host": *host, "ports": ports})
	fail(err)
	done := make(chan error, len(servers))
	for i, srv := range servers {
		go func(srv *http.Server, ln net.Listener) { done <- srv.ServeTLS(ln, "", "") }(srv, listeners[i])
	}
	fmt.Println(string(line))
	fail(<-done)
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "gobackend:", err)
		os.Exit(2)
	}
}
