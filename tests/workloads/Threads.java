// A JVM holding many threads and heap: THREADS threads (argv[1]) each add to their own counter
// every few milliseconds, and the heap holds HEAP_MIB (argv[2]) of pseudo-random longs. A line
// protocol on 127.0.0.1:PORT (argv[0]): `stat` answers `threads N ticks T heap H`, N the live
// counting threads, T the sum of their counters (which only grows), H a checksum of the heap.
// Run as a single source file: java Threads.java PORT THREADS HEAP_MIB.
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintWriter;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.util.concurrent.atomic.AtomicLongArray;

public class Threads {
    static long[] heap;
    static AtomicLongArray ticks;

    public static void main(String[] args) throws Exception {
        int port = Integer.parseInt(args[0]);
        int threads = Integer.parseInt(args[1]);
        heap = new long[Integer.parseInt(args[2]) << 17];
        long x = 88172645463325252L;
        for (int i = 0; i < heap.length; i++) {
            x ^= x << 13; x ^= x >>> 7; x ^= x << 17;
            heap[i] = x;
        }
        ticks = new AtomicLongArray(threads);
        for (int t = 0; t < threads; t++) {
            final int me = t;
            Thread counter = new Thread(() -> {
                while (true) {
                    ticks.incrementAndGet(me);
                    try { Thread.sleep(5); } catch (InterruptedException e) { return; }
                }
            }, "counter-" + t);
            counter.setDaemon(true);
            counter.start();
        }
        try (ServerSocket server = new ServerSocket(port, 50, InetAddress.getLoopbackAddress())) {
            System.out.println("ready");
            System.out.flush();
            while (true) {
                Socket client = server.accept();
                Thread serve = new Thread(() -> answer(client));
                serve.setDaemon(true);
                serve.start();
            }
        }
    }

    static void answer(Socket client) {
        try (client;
             BufferedReader in = new BufferedReader(new InputStreamReader(client.getInputStream()));
             PrintWriter out = new PrintWriter(client.getOutputStream(), true)) {
            String line;
            while ((line = in.readLine()) != null) {
                if (!line.equals("stat")) { out.println("?"); continue; }
                long total = 0, sum = 0;
                int live = 0;
                for (Thread t : Thread.getAllStackTraces().keySet()) {
                    if (t.getName().startsWith("counter-") && t.isAlive()) live++;
                }
                for (int i = 0; i < ticks.length(); i++) total += ticks.get(i);
                for (long v : heap) sum = sum * 31 + v;
                out.println("threads " + live + " ticks " + total + " heap " + Long.toHexString(sum));
            }
        } catch (Exception e) {
            // The client went away.
        }
    }
}
